"""Ray's own PyTorch example scripts, from the Ray wheel, run on outlast.

Each script runs twice: unchanged through `outlast run`, and after the mechanical rename
(`outlast.compat.rename`) with plain `python`. Dataset downloads are replaced by synthetic
data of the same shape (tests/compat/shim, on the scripts' path only). The wheel is fetched
at test time and cached outside the repository (outlast/compat/ray_source.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from outlast.compat.rename import rename_source
from outlast.compat.ray_source import ray_source

SHIM = Path(__file__).parent / "shim"
EXAMPLES = "ray/train/examples/pytorch"
RAY_INSTALLED = importlib.util.find_spec("ray") is not None


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...] = ()
    gpu: str | None = None  # why the script needs a GPU, if it does
    stops: str | None = None  # the Ray API `outlast run` stops the script at, if any
    rename_needs_ray: bool = False  # after the rename the script still calls ray.init() (outlast run accepts it)
    elsewhere: str | None = None  # the test that runs it instead, and why


# Every PyTorch example of the wheel, and what to expect of it. A new example in a new Ray
# release fails test_every_example_has_an_expectation until it is added here.
CASES = {
    "torch_linear_example.py": Case(args=("--smoke-test",), rename_needs_ray=True),
    "torch_quick_start.py": Case(),
    "torch_fashion_mnist_example.py": Case(gpu="its __main__ trains with ScalingConfig(use_gpu=True)"),
    "torch_regression_example.py": Case(args=("--smoke-test",), rename_needs_ray=True, elsewhere=(
        "it reads its CSV from S3: test_ray_data_examples.py runs it against the tests' S3 server")),
    "torch_data_prefetch_benchmark/auto_pipeline_for_host_to_device_data_transfer.py": Case(
        gpu="it times its epochs with torch.cuda.Event, and trains with ScalingConfig(use_gpu=True)"),
}


@pytest.fixture(scope="module")
def examples() -> Path:
    return ray_source() / EXAMPLES


def test_every_example_has_an_expectation(examples):
    found = {p.relative_to(examples).as_posix() for p in examples.rglob("*.py") if p.name != "__init__.py"}
    assert found == set(CASES)


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(Path(__file__).parents[2])])
    env["OUTLAST_STORAGE_PATH"] = str(tmp_path / "storage")
    env["OUTLAST_SHIM_DATASET_SIZE"] = "128"
    return env


def _finished_runs(tmp_path: Path) -> list[dict]:
    states = [json.loads(p.read_text()) for p in (tmp_path / "storage").glob("*/run_state.json")]
    return [s for s in states if s["status"] == "finished"]


def _check(proc: subprocess.CompletedProcess, case: Case, tmp_path: Path, how: str) -> None:
    explain = f"{how} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    if case.stops:
        assert proc.returncode != 0, explain
        return
    assert proc.returncode == 0, explain
    runs = _finished_runs(tmp_path)
    assert runs and all(len(r["attempts"]) == 1 for r in runs), explain


def _cases(mode: str):
    for name, case in CASES.items():
        if case.elsewhere and mode == "run":
            continue
        marks = [pytest.mark.torch]
        if case.gpu:
            marks.append(pytest.mark.skipif(not _cuda(), reason=f"needs a GPU: {case.gpu}"))
        yield pytest.param(name, case, id=name.rsplit("/", 1)[-1].removesuffix(".py"), marks=marks)


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.parametrize("name,case", list(_cases("run")))
def test_unchanged_through_outlast_run(name, case, examples, tmp_path):
    script = examples / name
    proc = subprocess.run([sys.executable, "-m", "outlast.cli.main", "run", str(script), *case.args],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    _check(proc, case, tmp_path, f"outlast run {name}")
    if case.stops:
        line = next(i for i, text in enumerate(script.read_text().splitlines(), 1) if case.stops in text)
        assert proc.returncode == 2
        assert f"outlast run: {case.stops} at {script}, line {line} is not supported" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name,case", list(_cases("rename")))
def test_after_the_mechanical_rename(name, case, examples, tmp_path):
    renamed = tmp_path / "renamed" / name
    renamed.parent.mkdir(parents=True)
    text = rename_source((examples / name).read_text())
    assert "ray.train" not in text
    renamed.write_text(text)
    proc = subprocess.run([sys.executable, str(renamed), *case.args], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=240)
    if (case.rename_needs_ray or case.stops) and RAY_INSTALLED:
        pytest.skip("after the rename this script calls the real Ray, installed here")
    if case.rename_needs_ray or case.stops:
        # What is left of Ray after the rename (import ray, ray.init()) needs Ray itself: `outlast run` is the way.
        assert proc.returncode != 0 and "No module named 'ray'" in proc.stderr, proc.stderr[-3000:]
        return
    _check(proc, case, tmp_path, f"python {renamed}")


@pytest.mark.torch
def test_the_fashion_mnist_examples_own_function_on_cpu_imported_from_its_module(examples, tmp_path):
    # Its __main__ asks for GPUs; its train_fashion_mnist(use_gpu=False) runs the same code on CPUs. The
    # train function lives in the example's module, which imports ray.train at its top in every worker.
    driver = tmp_path / "drive.py"
    driver.write_text(f"import sys\nsys.path.insert(0, {str(examples)!r})\n"
                      "from torch_fashion_mnist_example import train_fashion_mnist\n"
                      "train_fashion_mnist(num_workers=2, use_gpu=False)\n")
    env = {**_env(tmp_path), "OUTLAST_SHIM_DATASET_SIZE": "32", "HOME": str(tmp_path)}  # its FileLock is in ~
    proc = subprocess.run([sys.executable, "-m", "outlast.cli.main", "run", str(driver)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    _check(proc, Case(), tmp_path, "outlast run drive.py (train_fashion_mnist on CPU)")
    (run,) = _finished_runs(tmp_path)
    assert set(run["last_metrics"]) == {"loss", "accuracy"}
