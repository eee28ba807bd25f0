"""What Slurm gave a job, read from the environment it starts the batch script and steps in (pure).

Slurm writes node lists in its compressed hostlist form (`gpu[01-03,07],login1`) and
per-node counts as `2(x3),1`; both are expanded here so that everything else sees one entry
per node, in Slurm's order (the first node is where the batch script runs).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec


class SlurmEnvError(ValueError):
    """The environment is not that of a Slurm allocation, or Slurm wrote something unexpected."""


class Allocation(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    nodes: list[str]  # Slurm's node names, the batch host first
    cpus: dict[str, float]  # node -> CPUs the job holds there
    restart_count: int  # how many times the job was requeued before this start
    partition: str = ""


def expand_hostlist(text: str) -> list[str]:
    """`n[1-3,7],gpu[01-02]` -> n1 n2 n3 n7 gpu01 gpu02 (zero padding kept, as Slurm does)."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        if not item:
            continue
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", item)
        if m is None:
            if "[" in item or "]" in item:
                raise SlurmEnvError(f"cannot read the Slurm host list {text!r}: {item!r} has unbalanced brackets")
            names.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            lo, sep, hi = part.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise SlurmEnvError(f"cannot read the Slurm host list {text!r}: {part!r} is not N or N-M")
            width = len(lo)
            start, end = int(lo), int(hi) if sep else int(lo)
            if end < start:
                raise SlurmEnvError(f"cannot read the Slurm host list {text!r}: the range {part!r} runs backwards")
            names += [f"{prefix}{i:0{width}d}{suffix}" for i in range(start, end + 1)]
    return names


def _split_top(text: str) -> list[str]:
    """Split at the commas that are not inside brackets."""
    out, depth, cur = [], 0, []
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def expand_counts(text: str) -> list[int]:
    """`2(x3),1` -> [2, 2, 2, 1]: Slurm's per-node counts (SLURM_JOB_CPUS_PER_NODE, SLURM_TASKS_PER_NODE)."""
    out: list[int] = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if m is None:
            raise SlurmEnvError(f"cannot read the Slurm per-node count {text!r}: {item!r} is not N or N(xM)")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def allocation_from_env(env: Mapping[str, str]) -> Allocation:
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        raise SlurmEnvError("not inside a Slurm allocation (SLURM_JOB_ID and SLURM_JOB_NODELIST are not set): run "
                            "`outlast slurm -- ...` from an sbatch script or an salloc shell")
    nodes = expand_hostlist(nodelist)
    counts = expand_counts(env.get("SLURM_JOB_CPUS_PER_NODE", "")) or [1] * len(nodes)
    if len(counts) != len(nodes):
        raise SlurmEnvError(f"SLURM_JOB_CPUS_PER_NODE={env.get('SLURM_JOB_CPUS_PER_NODE')!r} names {len(counts)} "
                            f"nodes but SLURM_JOB_NODELIST={nodelist!r} has {len(nodes)}")
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    if not restarts.isdigit():
        raise SlurmEnvError(f"SLURM_RESTART_COUNT={restarts!r} is not a count")
    return Allocation(job_id=job_id, nodes=nodes, cpus={n: float(c) for n, c in zip(nodes, counts)},
                      restart_count=int(restarts), partition=env.get("SLURM_JOB_PARTITION", ""))


def gpus_on_node(env: Mapping[str, str]) -> int:
    """The GPUs Slurm gave the job on the node whose step environment this is (GRES gpu)."""
    count = env.get("SLURM_GPUS_ON_NODE", "")
    if count.isdigit():
        return int(count)
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        ids = [i for i in env.get(name, "").split(",") if i.strip()]
        if ids:
            return len(ids)
    return 0


def not_on_first_node(env: Mapping[str, str], alloc: Allocation) -> str | None:
    """Why `outlast slurm` cannot run here (None: it can). The head agent publishes its address in a
    directory of the first node, so the launcher runs there: a batch script does, an `salloc` shell
    on a login node does not."""
    here = env.get("SLURMD_NODENAME", "")
    if here == alloc.nodes[0]:
        return None
    where = f"on node {here}" if here else "outside the job's nodes (an salloc shell on a login node?)"
    return (f"this runs {where}, but the job's first node is {alloc.nodes[0]}: run `outlast slurm` from the batch "
            f"script, or from a shell on {alloc.nodes[0]} (`srun --nodes=1 --pty -w {alloc.nodes[0]} bash`)")
