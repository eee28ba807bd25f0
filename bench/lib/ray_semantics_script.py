"""A Ray Train script that prints what its Result says, run unchanged on Ray and with `outlast run`.

    python bench/lib/ray_semantics_script.py STORAGE_DIR          # on Ray (bench/.ray-venv)
    outlast run bench/lib/ray_semantics_script.py STORAGE_DIR     # on outlast

Two workers report three checkpoints scored on loss (3, 1, 2; num_to_keep=2, mode min), each with
metadata, then a report without a checkpoint; every rank writes model.pt with its own bytes. The
last line of stdout is one JSON document.
"""

import json
import os
import sys
import tempfile

import ray
import ray.train
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def train_fn(config):
    rank = ray.train.get_context().get_world_rank()
    for epoch, loss in enumerate([3.0, 1.0, 2.0]):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "model.pt"), "w") as f:
                f.write(f"rank {rank} epoch {epoch}")
            checkpoint = Checkpoint.from_directory(d)
            checkpoint.set_metadata({"epoch": epoch})
            ray.train.report({"loss": loss, "epoch": epoch}, checkpoint=checkpoint)
    ray.train.report({"loss": 0.5, "epoch": 99})
    reported = ray.train.get_all_reported_checkpoints()
    return {"rank": rank, "reported": [r.metrics["epoch"] for r in reported]}


def main():
    ray.init(num_cpus=2, include_dashboard=False)
    result = TorchTrainer(
        train_fn, scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="semantics", storage_path=os.path.abspath(sys.argv[1]),
                             checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss",
                                                                checkpoint_score_order="min")),
    ).fit()
    best = result.get_best_checkpoint("loss", "min")
    with result.checkpoint.as_directory() as d:
        with open(os.path.join(d, "model.pt")) as f:
            model = f.read()
    ray.shutdown()
    print(json.dumps({
        "metrics": result.metrics,
        "best_checkpoints": [m for _, m in result.best_checkpoints],
        "best_checkpoint_metadata": best.get_metadata(),
        "metrics_dataframe_epochs": list(result.metrics_dataframe["epoch"]),
        "return_value": result.return_value,
        "latest_model_pt": model,
    }))


if __name__ == "__main__":
    main()
