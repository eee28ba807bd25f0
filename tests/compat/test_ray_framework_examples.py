"""The examples in the docstrings of Ray's framework trainers, from the Ray 2.60.0 wheel, run unchanged
through `outlast run` (the wheel is fetched at test time and cached outside the repository)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from outlast.compat.ray_source import docstring_examples, ray_source


@dataclass(frozen=True)
class Case:
    needs: str  # the package it imports
    runs: bool = True  # False: it stops at `stops` under `outlast run`, as it should
    stops: str = ""
    skipped_by_ray: str = ""  # why Ray's own doc build does not run it either


# (file in the wheel, the documented name) -> what to expect of its examples.
CASES = {
    ("ray/train/v2/xgboost/xgboost_trainer.py", "XGBoostTrainer"): Case("xgboost"),
    ("ray/train/v2/lightgbm/lightgbm_trainer.py", "LightGBMTrainer"): Case("lightgbm"),
    ("ray/train/v2/jax/jax_trainer.py", "JaxTrainer"): Case(
        "jax", skipped_by_ray="it trains MaxText on a TPU slice (ScalingConfig(use_tpu=True, topology='4x4'))"),
}


def _params():
    for (path, name), case in CASES.items():
        yield pytest.param(path, name, case, id=name)


@pytest.mark.parametrize("path,name,case", list(_params()))
def test_a_framework_trainers_docstring_example_runs_unchanged(path, name, case, tmp_path):
    blocks = docstring_examples(ray_source() / path, name)
    assert blocks, f"{path}: {name}'s docstring has no example any more"
    if case.skipped_by_ray:
        assert all(skipped for _, skipped in blocks), f"Ray now runs {name}'s example: expect it here too"
        pytest.skip(f"Ray's doc build skips it too: {case.skipped_by_ray}")
    pytest.importorskip(case.needs)  # the example imports it before anything of Ray
    code, _ = blocks[0]
    script = tmp_path / f"{name}_example.py"
    script.write_text(code)
    env = {**os.environ, "OUTLAST_STORAGE_PATH": str(tmp_path / "storage"),
           "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-m", "outlast.cli.main", "run", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    explain = f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    if not case.runs:
        assert proc.returncode == 2 and f"{case.stops} at {script}" in proc.stderr, explain
        return
    assert proc.returncode == 0, explain
    states = [json.loads(p.read_text()) for p in (tmp_path / "storage").glob("*/run_state.json")]
    assert [s["status"] for s in states] == ["finished"], explain
