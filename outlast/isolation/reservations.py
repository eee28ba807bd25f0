"""How much memory and CPU the node keeps for its own processes: a pure function of the machine."""

from __future__ import annotations

from dataclasses import dataclass

from outlast.isolation.errors import BadSetting
from outlast.isolation.units import format_bytes

MiB = 1024**2
GiB = 1024**3

DEFAULT_MEMORY_FRACTION = 0.10
DEFAULT_MEMORY_MIN = 500 * MiB
DEFAULT_MEMORY_MAX = 10 * GiB
DEFAULT_CPU_FRACTION = 0.05
DEFAULT_CPU_MIN = 1.0
DEFAULT_CPU_MAX = 3.0
# Workloads need something to run in; a reservation that leaves them less is a mistake.
MIN_USER_MEMORY = 64 * MiB
# The memory tier's budget when `--checkpoint-memory` is not given: 2 GiB, or an eighth of a node
# under 16 GiB, and never more than leaves the workloads MIN_USER_MEMORY: a default that refuses to
# start a small node would be a default no one can use there.
DEFAULT_CHECKPOINT_MEMORY = 2 * GiB
DEFAULT_CHECKPOINT_FRACTION = 1 / 8


def default_checkpoint_memory(total_memory: int, reserved: int = 0) -> int:
    """The memory tier's default budget on a node of `total_memory`, `reserved` of it kept for the system."""
    room = max(total_memory - reserved - MIN_USER_MEMORY, 0)
    return min(DEFAULT_CHECKPOINT_MEMORY, int(total_memory * DEFAULT_CHECKPOINT_FRACTION), room)


@dataclass(frozen=True)
class Reservations:
    total_memory: int  # min(physical, the limit of the cgroup outlast starts in)
    system_memory: int  # reserved for the agent and other node services
    user_memory: int  # total - reserved: the limit of all workloads together
    total_cpus: float
    system_cpus: float
    reason: str  # where the numbers came from, for the log and `outlast status`
    checkpoint_memory: int = 0  # the memory tier's budget, part of system_memory

    @property
    def user_cpus(self) -> float:
        return max(self.total_cpus - self.system_cpus, 0.0)

    def system_weight(self, scale: int) -> int:
        """The system's share of `scale` CPU weight (cpu.weight 10000, or cpu.shares)."""
        share = self.system_cpus / self.total_cpus if self.total_cpus else 0.0
        return min(max(round(scale * share), 1), scale - 1)


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def compute_reservations(physical_memory: int, cgroup_limit: int | None, cpus: float,
                         reserved_memory: int | None = None, reserved_cpus: float | None = None,
                         checkpoint_memory: int | None = 0) -> Reservations:
    """Defaults: 10% of memory (500 MiB to 10 GiB) and 5% of the cores (1 to 3), never all of either.
    The memory tier's budget (`checkpoint_memory`) is the agent's too, so it is reserved on top;
    None: its default, fitted to the node (default_checkpoint_memory)."""
    total = physical_memory if cgroup_limit is None else min(physical_memory, cgroup_limit)
    why = [f"total memory {format_bytes(total)} = min(physical {format_bytes(physical_memory)}, "
           f"cgroup limit {format_bytes(cgroup_limit) if cgroup_limit is not None else 'none'})"]
    if reserved_memory is None:
        mem = int(_clamp(total * DEFAULT_MEMORY_FRACTION, DEFAULT_MEMORY_MIN, DEFAULT_MEMORY_MAX))
        why.append(f"reserved memory {format_bytes(mem)} (default: 10%, at least 500 MiB, at most 10 GiB)")
    else:
        mem = reserved_memory
        why.append(f"reserved memory {format_bytes(mem)} (--system-reserved-memory)")
    given = checkpoint_memory is not None
    if checkpoint_memory is None:
        checkpoint_memory = default_checkpoint_memory(total, mem)
        why.append(f"+ {format_bytes(checkpoint_memory)} of checkpoint memory (default: 2 GiB, at most an eighth "
                   "of the node's memory, and what leaves the workloads 64 MiB)")
    elif checkpoint_memory:
        why.append(f"+ {format_bytes(checkpoint_memory)} of checkpoint memory (--checkpoint-memory)")
    mem += checkpoint_memory
    if total - mem < MIN_USER_MEMORY:
        if checkpoint_memory and given:
            raise BadSetting(
                f"reserving {format_bytes(mem)} for the system, {format_bytes(checkpoint_memory)} of it checkpoint "
                f"memory, leaves {format_bytes(max(total - mem, 0))} of {format_bytes(total)} to workloads; lower "
                "--checkpoint-memory or --system-reserved-memory")
        raise BadSetting(
            f"reserving {format_bytes(mem)} for the system leaves {format_bytes(max(total - mem, 0))} of "
            f"{format_bytes(total)} to workloads; lower --system-reserved-memory or give the node more memory"
        )
    if reserved_cpus is None:
        cpu = _clamp(cpus * DEFAULT_CPU_FRACTION, DEFAULT_CPU_MIN, DEFAULT_CPU_MAX)
        why.append(f"reserved CPU {cpu:g} of {cpus:g} cores (default: 5%, at least 1, at most 3)")
    else:
        cpu = reserved_cpus
        why.append(f"reserved CPU {cpu:g} of {cpus:g} cores (--system-reserved-cpu)")
    if cpu >= cpus and reserved_cpus is not None:
        raise BadSetting(f"reserving {cpu:g} cores for the system leaves none of the {cpus:g} to workloads; "
                         "lower --system-reserved-cpu")
    # On a one- or two-core machine the default minimum of one core would be all or half of it:
    # a weight, not a hard cap, so workloads still use idle cycles; keep it below the total.
    cpu = min(cpu, cpus * 0.5) if reserved_cpus is None and cpus <= 2 else cpu
    return Reservations(total_memory=total, system_memory=mem, user_memory=total - mem,
                        total_cpus=cpus, system_cpus=cpu, reason="; ".join(why), checkpoint_memory=checkpoint_memory)
