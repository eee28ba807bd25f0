"""A Ray example's printed metrics under `outlast run`, against what the real Ray printed for the same script.

tests/compat/record_ray_metrics.py ran Ray's torch_linear_example.py under Ray 2.60.0, on one worker and on
two, and kept what it printed (tests/compat/ray_metrics.json). Here the same file, from the same wheel (its
SHA-256 checked), runs unchanged under `outlast run` with the same arguments and the same seeding
(tests/compat/seeded on the PYTHONPATH: torch's default generator seeded as torch is imported), and must
print the same metrics.

Equal, not close: on either world size both read the same rows in the same order into the same model from the
same initial weights, with the same torch build on CPU, so every float is the same. On two workers each rank
reads a DistributedSampler's rows (rank r: rows r, r + 2, ...; 1000 and 400 rows divide by 2, so neither
pads nor leaves a row out), DDP averages the same gradients over gloo, and the loss printed is rank 0's. An
epoch that reads nothing, a loader that cannot be walked again, a step lost or taken twice, or a rank given
other rows than Ray's changes the loss it prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from outlast.compat.ray_alias import RAY_VERSION
from outlast.compat.ray_source import ray_source
from tests.compat.record_ray_metrics import CASES, RECORD, ROOT, SEEDED, printed_metrics, script_hash


@pytest.mark.torch
@pytest.mark.parametrize("args", CASES, ids=lambda case: "-".join(case).strip("-"))
def test_ray_examples_printed_metrics_are_rays(tmp_path, args):
    record = json.loads(RECORD.read_text())
    script = ray_source() / record["script"]
    again = "record it again with tests/compat/record_ray_metrics.py (it runs the script under Ray)"
    assert record["ray_version"] == RAY_VERSION, f"recorded under Ray {record['ray_version']}: {again}"
    assert script_hash(script) == record["script_sha256"], f"{script} is not the script recorded: {again}"
    recorded = {tuple(case["args"]): case["metrics"] for case in record["cases"]}
    assert args in recorded, f"{' '.join(args)} was not recorded: {again}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SEEDED), str(ROOT)]),
               OUTLAST_STORAGE_PATH=str(tmp_path / "storage"))
    proc = subprocess.run([sys.executable, "-m", "outlast.cli.main", "run", str(script), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    import torch

    # Another torch build may round otherwise: the message names both.
    assert printed_metrics(proc.stdout) == recorded[args], (
        f"torch {torch.__version__} here, {record['torch_version']} under Ray\n{proc.stdout[-2000:]}")
