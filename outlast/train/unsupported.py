"""Ray Train names outlast does not offer, each with what to do instead.

`outlast.train` and `outlast.train.torch` raise these messages for such a name (as an
ImportError, which `from ... import` passes on as it is), and the parity table in
docs/ray-parity.md quotes them.
"""

from __future__ import annotations

TRAIN: dict[str, str] = {
    "BackendConfig": "outlast's trainers set up their framework themselves; use TorchTrainer (TorchConfig) or "
                     "DataParallelTrainer",
    "SyncConfig": "checkpoints go straight to RunConfig(storage_path=...); there is nothing to sync (Ray V2 "
                  "deprecated SyncConfig too)",
    "LoggingConfig": "outlast logs through Python's logging under the 'outlast' logger; set its level there",
    "UserCallback": "outlast calls no code in the driver during a run; log from the train function on rank 0, or "
                    "read Result.metrics_dataframe after fit()",
    "NCCLHangError": "a hung collective surfaces as torch.distributed's own timeout (TorchConfig(timeout_s=...)), "
                     "which fails the rank and restarts the group",
    "ValidationConfig": "validate in the train function and report the validation metrics with the checkpoint",
    "ValidationFn": "validate in the train function and report the validation metrics with the checkpoint",
    "ValidationTaskConfig": "validate in the train function and report the validation metrics with the checkpoint",
}

TORCH: dict[str, str] = {
    "TorchCheckpoint": "save with torch.save into a directory and report Checkpoint.from_directory(that directory)",
}


def refuse(module: str, table: dict[str, str], name: str) -> Exception:
    if name in table:
        return ImportError(f"{module}.{name} is not supported by outlast: {table[name]}")
    return AttributeError(f"module {module!r} has no attribute {name!r}")
