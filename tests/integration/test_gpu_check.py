"""scripts/gpu-check's own logic, on a machine without a GPU: one JSON line per case and a summary,
a clear failure for each case when CUDA is absent (and exit status 1), a clear setup failure when
torch is absent, and which cases run, skip or fail on a machine of N GPUs. The cases themselves
need a GPU (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import decide, verdict
from bench.lib.gpu_cases import CASES

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "bench" / "results" / "gpu-check.json"


def _check(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "scripts" / "gpu-check"), *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.torch
def test_without_cuda_every_case_fails_saying_so_one_json_line_each_and_the_exit_status_is_1():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the check would run its cases")
    before = RESULT.stat().st_mtime if RESULT.exists() else None
    proc = _check({"PYTHON": sys.executable})
    assert proc.returncode == 1, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["case"] for line in lines] == [c.name for c in CASES] + ["summary"]
    for line in lines[:-1]:
        assert line["status"] == "failed" and line["error"].startswith("no CUDA device: torch "), line
        assert "sees no GPU; install a CUDA build of torch (docs/gpu.md)" in line["error"]
    assert lines[-1]["status"] == "failed" and lines[-1]["failed"] == len(CASES) and lines[-1]["passed"] == 0
    assert lines[-1]["machine"]["devices"] == 0
    assert (RESULT.stat().st_mtime if RESULT.exists() else None) == before  # no device: no result file


def test_without_torch_the_setup_fails_as_one_json_line(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    proc = _check({"PYTHON": str(tmp_path / "bare" / "bin" / "python")})
    assert proc.returncode == 1
    [line] = [json.loads(line) for line in proc.stdout.splitlines()]
    assert line["case"] == "setup" and line["status"] == "failed"
    assert line["error"].startswith("torch is not installed for ") and "install a CUDA build of torch" in line["error"]


def test_an_unknown_case_is_refused_naming_the_cases():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--only", "nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown case(s) ['nope']" in proc.stderr and CASES[0].name in proc.stderr


def test_which_cases_run_skip_or_fail_on_a_machine_of_n_gpus():
    one, two = next(c for c in CASES if c.gpus == 1), next(c for c in CASES if c.gpus == 2)
    none = {"devices": 0, "why": "no CUDA device: ..."}
    assert decide(one, none, 0, 400) == {"status": "failed", "error": "no CUDA device: ..."}
    assert decide(one, {"devices": 1}, 0, 400) is None
    skipped = decide(two, {"devices": 1}, 0, 400)
    assert skipped["status"] == "skipped" and skipped["error"].startswith("needs 2 GPUs, this machine has 1")
    assert decide(two, {"devices": 8}, 0, 400) is None
    assert decide(one, {"devices": 1}, 401, 400)["error"] == "not started: the check's 400 s were spent"
    assert {c.gpus for c in CASES} == {1, 2} and sum(c.gpus == 2 for c in CASES) == 3


def test_the_exit_status_is_1_only_when_a_case_failed():
    assert verdict([{"status": "passed"}, {"status": "skipped"}]) == 0
    assert verdict([{"status": "passed"}, {"status": "failed"}]) == 1
    assert verdict([]) == 0
