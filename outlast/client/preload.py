"""What a node's fork server imports before its first fork: one default for every way a node
starts (`outlast start`, `outlast slurm`, `LocalCluster`, the node a driver embeds).

Without it, each worker pays the imports itself: torch._dynamo alone, which DDP's constructor
imports, costs about 1.8 s per worker.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Mapping

# torch, what DistributedDataParallel pulls in on first use, and outlast's helpers for it.
TORCH_MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch.utils.data", "torch._dynamo",
                 "outlast.train.torch")
ENV_VAR = "OUTLAST_PRELOAD"  # comma-separated modules; set and empty: preload nothing


def default_preload(env: Mapping[str, str] = os.environ) -> list[str]:
    """`$OUTLAST_PRELOAD` when set, else torch's modules when torch is installed, else nothing."""
    if ENV_VAR in env:
        return parse(env[ENV_VAR])
    return list(TORCH_MODULES) if importlib.util.find_spec("torch") is not None else []


def parse(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def with_default(extra: Iterable[str], env: Mapping[str, str] = os.environ) -> list[str]:
    """The default, then what a trainer's backend adds, each once."""
    return list(dict.fromkeys([*default_preload(env), *extra]))
