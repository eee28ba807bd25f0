"""Settings of resource isolation, for `outlast start` and for the embedded node alike."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from outlast.isolation.errors import BadSetting
from outlast.isolation.units import parse_bytes, parse_cpus


@dataclass(frozen=True)
class IsolationConfig:
    """`outlast start --enable-resource-isolation ...` as a Python value.

    Sizes accept units (`"2GiB"`, `"512M"`) or bytes; CPU is in cores. Reservations without
    `enable_resource_isolation=True` are refused: they would silently do nothing.
    """

    enable_resource_isolation: bool = False
    cgroup_path: str | None = None  # default: the cgroup the agent starts in
    system_reserved_cpu: float | str | None = None
    system_reserved_memory: int | str | None = None
    kill_at: float = 0.95  # fraction of the workloads' limit at which outlast kills
    target: float = 0.90  # kill until memory would be below this fraction
    checkpoint_memory: int | None = 0  # the node's memory tier, reserved with the system's; None: fitted to the node

    def __post_init__(self) -> None:
        if not self.enable_resource_isolation:
            given = [name for name, value in (("system_reserved_cpu", self.system_reserved_cpu),
                                              ("system_reserved_memory", self.system_reserved_memory),
                                              ("cgroup_path", self.cgroup_path)) if value is not None]
            if given:
                flags = ", ".join("--" + g.replace("_", "-") for g in given)
                raise BadSetting(f"{flags} given without --enable-resource-isolation; add it (or "
                                 "enable_resource_isolation=True), or drop the setting")
        if self.system_reserved_memory is not None:
            object.__setattr__(self, "system_reserved_memory",
                               parse_bytes(self.system_reserved_memory, "--system-reserved-memory"))
        if self.system_reserved_cpu is not None:
            object.__setattr__(self, "system_reserved_cpu",
                               parse_cpus(self.system_reserved_cpu, "--system-reserved-cpu"))
        if not 0 < self.target < self.kill_at <= 1:
            raise BadSetting(f"kill_at ({self.kill_at}) and target ({self.target}) must satisfy "
                             "0 < target < kill_at <= 1")

    @property
    def reserved_memory_bytes(self) -> int | None:
        """`system_reserved_memory` in bytes (None: the default)."""
        given = self.system_reserved_memory
        return None if given is None else parse_bytes(given, "--system-reserved-memory")

    @property
    def reserved_cpus(self) -> float | None:
        """`system_reserved_cpu` in cores (None: the default)."""
        given = self.system_reserved_cpu
        return None if given is None else parse_cpus(given, "--system-reserved-cpu")

    def to_args(self) -> list[str]:
        """The agent's command line for these settings."""
        if not self.enable_resource_isolation:
            return []
        args = ["--enable-resource-isolation", "--kill-at", str(self.kill_at), "--kill-target", str(self.target)]
        if self.cgroup_path is not None:
            args += ["--cgroup-path", self.cgroup_path]
        if self.system_reserved_cpu is not None:
            args += ["--system-reserved-cpu", str(self.system_reserved_cpu)]
        if self.system_reserved_memory is not None:
            args += ["--system-reserved-memory", str(self.system_reserved_memory)]
        return args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The same options on `outlast start` and `python -m outlast.agent`."""
    g = parser.add_argument_group("resource isolation")
    g.add_argument("--enable-resource-isolation", action="store_true",
                   help="put the node's own processes and the workloads in separate cgroups, and kill "
                        "workloads by outlast's policy before the kernel has to")
    g.add_argument("--cgroup-path", default=None,
                   help="the cgroup outlast manages (default: the one the agent starts in)")
    g.add_argument("--system-reserved-cpu", default=None,
                   help="cores kept for the node's own processes (default: 5%%, at least 1, at most 3)")
    g.add_argument("--system-reserved-memory", default=None,
                   help="memory kept for the node's own processes, e.g. 2GiB (default: 10%%, at least "
                        "500 MiB, at most 10 GiB)")
    g.add_argument("--kill-at", type=float, default=0.95, help=argparse.SUPPRESS)
    g.add_argument("--kill-target", type=float, default=0.90, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> IsolationConfig:
    return IsolationConfig(
        enable_resource_isolation=args.enable_resource_isolation, cgroup_path=args.cgroup_path,
        system_reserved_cpu=args.system_reserved_cpu, system_reserved_memory=args.system_reserved_memory,
        kill_at=args.kill_at, target=args.kill_target,
    )


def cpu_count() -> float:
    """Cores this process may run on."""
    try:
        return float(len(os.sched_getaffinity(0)))
    except AttributeError:
        return float(os.cpu_count() or 1)
