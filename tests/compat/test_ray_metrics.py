"""A Ray example's printed metrics under `outlast run`, against what the real Ray printed for the same script.

tests/compat/record_ray_metrics.py ran Ray's torch_linear_example.py under Ray 2.60.0 and kept what it
printed (tests/compat/ray_metrics.json). Here the same file, from the same wheel (its SHA-256 checked),
runs unchanged under `outlast run` with the same arguments and the same seeding (tests/compat/seeded on
the PYTHONPATH: torch's default generator seeded as torch is imported), and must print the same metrics.

Equal, not close: on one worker both read the same rows in the same order into the same model from the same
initial weights, with the same torch build on CPU, so every float is the same. An epoch that reads nothing,
a loader that cannot be walked again, a step lost or taken twice changes the loss it prints.

Not compared: the same script on 2 workers. Ray's prepare_data_loader gives each rank a DistributedSampler's
strided rows (rank r reads rows r, r + 2, ...); outlast's gives each rank a contiguous share
(docs/ray-parity.md, `prepare_data_loader`), so the ranks train and validate on other rows and the loss
differs by as much as the model does (0.51 on Ray, 0.27 on outlast, seeded as here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from outlast.compat.ray_alias import RAY_VERSION
from outlast.compat.ray_source import ray_source
from tests.compat.record_ray_metrics import RECORD, ROOT, SEEDED, printed_metrics, script_hash


@pytest.mark.torch
def test_ray_examples_printed_metrics_are_rays(tmp_path):
    record = json.loads(RECORD.read_text())
    script = ray_source() / record["script"]
    again = "record it again with tests/compat/record_ray_metrics.py (it runs the script under Ray)"
    assert record["ray_version"] == RAY_VERSION, f"recorded under Ray {record['ray_version']}: {again}"
    assert script_hash(script) == record["script_sha256"], f"{script} is not the script recorded: {again}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SEEDED), str(ROOT)]),
               OUTLAST_STORAGE_PATH=str(tmp_path / "storage"))
    proc = subprocess.run([sys.executable, "-m", "outlast.cli.main", "run", str(script), *record["args"]],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    import torch

    # Another torch build may round otherwise: the message names both.
    assert printed_metrics(proc.stdout) == record["metrics"], (
        f"torch {torch.__version__} here, {record['torch_version']} under Ray\n{proc.stdout[-2000:]}")

