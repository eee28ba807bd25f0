"""`save_async`: Ray Train's `torch.save` + `report(checkpoint=...)` pattern in one line, at
the cost to the training loop of one copy of the state into memory.

    # Ray Train:
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(state, os.path.join(tmp, "model.pt"))
        train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
    # outlast:
    outlast.train.torch.save_async(state, metrics, filename="model.pt")

The loop continues once every tensor is copied (to CPU memory, what
`torch.distributed.checkpoint.async_save` stages too); `torch.save` and the upload run
in the background, and the checkpoint commits once every rank's files are in. A later
checkpoint waits for this one's upload first (a notice's checkpoint excepted), so at most
one staged copy is alive per rank besides the one being written.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from outlast.train._session import get_session
from outlast.train.checkpoint import CheckpointUploadMode


def stage(obj: Any) -> Any:
    """A copy of `obj` whose tensors are CPU copies that later steps cannot change."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, stage(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(stage(v) for v in obj)
    return copy.deepcopy(obj)


def save_async(obj: Any, metrics: dict[str, Any], filename: str = "model.pt") -> None:
    """Report `metrics` with a checkpoint holding `torch.save(obj)` as `filename`, written and
    uploaded off the training thread. Call it on every rank that has state to save (each
    rank with its own `filename` when their states differ), like `report()`."""
    if not isinstance(filename, str) or not filename or os.path.isabs(filename) or ".." in Path(filename).parts:
        raise ValueError(f"save_async(filename={filename!r}): give a relative file name such as 'model.pt'")
    import torch

    staged = stage(obj)

    def write(directory: Path) -> None:
        target = directory / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save(staged, target)

    get_session("torch.save_async").report(metrics, upload_mode=CheckpointUploadMode.ASYNC, write=write)
