"""Which GPUs of a node each worker gets, and what its environment says about them.

A node's GPUs are named as CUDA names them to its agent: the agent's own `CUDA_VISIBLE_DEVICES`
when set (Slurm sets it for a job's step; an administrator may restrict a node), else the
`/dev/nvidiaN` devices the machine has. `--num-gpus N` (or Slurm's `SLURM_GPUS_ON_NODE`) takes the
first N of those, or `0..N-1` where none are seen: the operator's word is trusted, and CUDA itself
says so in the worker when a device is not there.

A worker asking GPUs is given whole devices (or a share of one for a request under 1, as Ray's
fractional GPUs) that no other live worker holds. As on Ray Train, every rank of a run on a node
sees all the GPUs the run holds there (`CUDA_VISIBLE_DEVICES`, in the node's order, so that NCCL
can use peer-to-peer between them) and learns its own by index (`OUTLAST_CUDA_DEVICES`), which is
what `get_device()` returns. All of it is pure but `dev_names`: the agent keeps a `GpuBook` and applies it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

VISIBLE = "CUDA_VISIBLE_DEVICES"
OWN = "OUTLAST_CUDA_DEVICES"  # a worker's own devices, as indices into its CUDA_VISIBLE_DEVICES


def visible_ids(value: str | None) -> list[str] | None:
    """The devices a CUDA_VISIBLE_DEVICES value names (None: the variable is not set)."""
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def dev_names() -> list[str]:
    try:
        return os.listdir("/dev")
    except OSError:
        return []


def detected_ids(dev_names: Iterable[str]) -> list[str]:
    """The GPUs of a machine from the names in /dev: nvidia0, nvidia1, ... (not nvidiactl, nvidia-uvm)."""
    found = [int(mt.group(1)) for name in dev_names if (mt := re.fullmatch(r"nvidia(\d+)", name))]
    return [str(i) for i in sorted(found)]


def node_gpu_ids(num_gpus: float | None, env: Mapping[str, str], dev_names: Iterable[str]) -> list[str]:
    """The ids of the GPUs this node offers; raises ValueError saying what to fix."""
    seen = visible_ids(env.get(VISIBLE))
    if seen is None:
        seen = detected_ids(dev_names)
    if num_gpus is None:
        return seen
    if num_gpus != int(num_gpus) or num_gpus < 0:
        raise ValueError(f"--num-gpus {num_gpus:g}: a node offers whole GPUs; give a whole number "
                         "(a worker may still ask a share of one, resources_per_worker={'GPU': 0.5})")
    n = int(num_gpus)
    if env.get(VISIBLE) is not None and n > len(seen):
        raise ValueError(f"--num-gpus {n} but {VISIBLE}={env[VISIBLE]!r} names {len(seen)} device(s): "
                         f"give --num-gpus {len(seen)} or less, or name more devices in {VISIBLE}")
    return seen[:n] if len(seen) >= n else [str(i) for i in range(n)]


K = TypeVar("K", bound=Hashable)  # what names a worker


@dataclass
class GpuBook(Generic[K]):
    """What each live worker of a node holds of its GPUs (a share of each device id)."""

    ids: list[str]
    held: dict[K, dict[str, float]] = field(default_factory=dict)

    def free(self) -> dict[str, float]:
        left = {i: 1.0 for i in self.ids}
        for shares in self.held.values():
            for i, share in shares.items():
                left[i] = left.get(i, 0.0) - share
        return left

    def assign(self, keys: list[K], per_worker: float) -> dict[K, list[str]] | str:
        """Devices for each worker of `keys`, taken together, or why they do not fit (nothing taken)."""
        if per_worker <= 0:
            return {k: [] for k in keys}
        if per_worker > 1 and per_worker != int(per_worker):
            return (f"each worker asks {per_worker:g} GPUs: ask a whole number of GPUs, or a share of one "
                    "(less than 1)")
        left = self.free()
        taken: dict[K, dict[str, float]] = {}
        for key in keys:
            if per_worker >= 1:
                whole = [i for i in self.ids if left[i] >= 1.0 - 1e-9][:int(per_worker)]
                if len(whole) < per_worker:
                    return self._no_fit(keys, per_worker)
                shares = {i: 1.0 for i in whole}
            else:
                share = next((i for i in self.ids if left[i] >= per_worker - 1e-9), None)
                if share is None:
                    return self._no_fit(keys, per_worker)
                shares = {share: per_worker}
            for i, s in shares.items():
                left[i] -= s
            taken[key] = shares
        self.held.update(taken)
        return {k: list(v) for k, v in taken.items()}

    def worker_envs(self, keys: list[K], per_worker: float, env: dict[str, str]) -> dict[K, dict[str, str]] | str:
        """Each worker's environment (`env` and its GPUs), its devices taken, or why they do not fit."""
        got = self.assign(keys, per_worker)
        if isinstance(got, str):
            return got
        run = [i for ids in got.values() for i in ids]
        return {k: {**env, **worker_gpu_env(self.ids, run, own)} if own else env for k, own in got.items()}

    def _no_fit(self, keys: list[K], per_worker: float) -> str:
        free = sum(max(0.0, v) for v in self.free().values())
        return (f"{len(keys)} worker(s) asking {per_worker:g} GPU(s) each do not fit in the "
                f"{free:g} of {len(self.ids)} GPU(s) free on this node")

    def release(self, key: K) -> None:
        self.held.pop(key, None)

    def release_all(self) -> None:
        self.held.clear()


def worker_gpu_env(node_ids: list[str], run_ids: Iterable[str], own: list[str]) -> dict[str, str]:
    """What a worker holding `own`, of a run holding `run_ids` on this node, has in its environment."""
    held = set(run_ids)
    visible = [i for i in node_ids if i in held]
    return {VISIBLE: ",".join(visible), OWN: ",".join(str(visible.index(i)) for i in own)}


def own_device_indices(env: Mapping[str, str], local_rank: int, device_count: int) -> list[int]:
    """The CUDA device indices a worker uses: those its node gave it, else Ray's guess from the local
    rank (a node that gave none: GPUs it was not told of)."""
    given = env.get(OWN, "")
    if given:
        return [int(i) for i in given.split(",")]
    return [local_rank % device_count] if device_count > 0 else []
