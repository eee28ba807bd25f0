"""Ray's example that trains on Ray Data, unchanged under `outlast run`, reading its CSV from the tests'
S3 server (the bucket and key the script names, with synthetic rows of the same columns)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from outlast.compat.ray_source import ray_source

ROOT = Path(__file__).parents[2]


def test_torch_regression_example_runs_unchanged_reading_its_csv_from_s3(s3, tmp_path):
    import boto3
    import pandas as pd

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 100))
    frame = pd.DataFrame({f"x{i:03d}": x[:, i] for i in range(100)}).assign(y=x[:, :3].sum(axis=1))
    buffer = io.StringIO()
    frame.to_csv(buffer, index=False)
    client = boto3.client("s3")
    client.create_bucket(Bucket="air-example-data")
    client.put_object(Bucket="air-example-data", Key="regression.csv", Body=buffer.getvalue().encode(),
                      ACL="public-read")  # read anonymously, as the script asks (s3://anonymous@...)

    script = ray_source() / "ray/train/examples/pytorch/torch_regression_example.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OUTLAST_STORAGE_PATH=str(tmp_path / "storage"))
    proc = subprocess.run([sys.executable, "-m", "outlast.cli.main", "run", str(script), "--smoke-test"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # three epochs, each validated on rank 0: the losses the script prints are numbers
    result = proc.stdout.strip().splitlines()[-1]
    assert result.startswith("Result(metrics={'loss': ") and result.count("'loss': ") >= 4, result
