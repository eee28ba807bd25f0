"""The examples of Train with Ray Data in the docstrings of Ray's own API (TorchTrainer and
get_dataset_shard, from the Ray 2.60.0 wheel, fetched at test time), run unchanged through `outlast run`;
what they read from S3 comes from the tests' S3 server, under the bucket and key the example names."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from outlast.compat.ray_source import docstring_examples, ray_source

ROOT = Path(__file__).parents[2]


def _run_example(path: str, name: str, tmp_path: Path, tail: str = "") -> tuple[subprocess.CompletedProcess, dict]:
    blocks = docstring_examples(ray_source() / path, name)
    assert blocks, f"{path}: {name}'s docstring has no example any more"
    code, skipped = blocks[0]
    assert not skipped, f"Ray's doc build no longer runs {name}'s example"
    script = tmp_path / f"{name}_example.py"
    script.write_text(code + tail)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OUTLAST_STORAGE_PATH=str(tmp_path / "storage"))
    proc = subprocess.run([sys.executable, "-m", "outlast.cli.main", "run", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    (state_file,) = (tmp_path / "storage").glob("*/run_state.json")
    return proc, json.loads(state_file.read_text())


def test_torch_trainers_example_trains_on_its_from_items_dataset(tmp_path):
    # The example ends on `final_loss = result.metrics["loss"]`: printed here, to see it is the checkpoint's.
    proc, state = _run_example("ray/train/v2/torch/torch_trainer.py", "TorchTrainer", tmp_path,
                               tail="\nprint('final_loss', final_loss)\n")
    assert state["status"] == "finished"
    (checkpoint,) = state["checkpoints"]  # one epoch, one report with a checkpoint
    loss = float(proc.stdout.strip().splitlines()[-1].split()[-1])
    assert math.isfinite(loss) and loss == checkpoint["metrics"]["loss"]


def test_get_dataset_shards_example_reads_its_csv_from_s3_on_two_workers(s3, tmp_path):
    import boto3
    import pandas as pd

    rng = np.random.default_rng(0)
    columns = ["sepal length (cm)", "sepal width (cm)", "petal length (cm)", "petal width (cm)"]
    frame = pd.DataFrame(rng.uniform(0.1, 8.0, size=(150, 4)).round(1), columns=columns)
    frame["target"] = rng.integers(0, 3, size=150)
    buffer = io.StringIO()
    frame.to_csv(buffer, index=False)
    client = boto3.client("s3")
    client.create_bucket(Bucket="ray-example-data")
    client.put_object(Bucket="ray-example-data", Key="iris.csv", Body=buffer.getvalue().encode(), ACL="public-read")

    _, state = _run_example("ray/train/v2/api/train_fn_utils.py", "get_dataset_shard", tmp_path)
    assert state["status"] == "finished"
    (attempt,) = state["attempts"]
    assert attempt["workers"] == 2
