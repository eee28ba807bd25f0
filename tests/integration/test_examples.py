"""The scripts in examples/ run end to end, as a user would run them, and do what they say.

Each test starts the example as its own process (`python examples/x.py ...`) with a
private OUTLAST_HOME, so it starts its own embedded node, and a temporary storage path,
then checks what the script printed and what the run left on storage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TIMEOUT_S = 120

pytestmark = pytest.mark.torch


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["OUTLAST_HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"
    for var in ("OUTLAST_ADDRESS", "OUTLAST_STORAGE_PATH"):
        env.pop(var, None)
    return env


def _run(script: str, args: list[str], home: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=REPO, env=_env(home),
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    return proc


def _explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


def _run_state(run_dir: Path) -> dict:
    return json.loads((run_dir / "run_state.json").read_text())


def _checkpoint_dirs(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("checkpoint_"))


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "outlast_home"
    path.mkdir()
    return path


# ---- examples/fault_tolerance_worker.py ---------------------------------------------------


def test_fault_tolerance_worker_recovers_from_injected_crash(tmp_path: Path, home: Path) -> None:
    import torch

    storage = tmp_path / "storage"
    proc = _run("fault_tolerance_worker.py", ["--storage_path", str(storage), "--run_name", "ft"], home)
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout

    # The crash happened, on rank 1 at epoch 3, and the run restarted because of it.
    assert "injected failure on rank 1 at epoch 3" in proc.stderr, _explain(proc)
    # Both new workers restored epoch 2's checkpoint and went on from epoch 3, not from 0.
    assert out.count("restored the checkpoint of epoch 2; resuming at epoch 3") == 2, _explain(proc)
    assert "recovered: the last attempt resumed at epoch 3" in out, _explain(proc)
    assert "finished at epoch 5" in out, _explain(proc)
    assert out.count("[rank 0] epoch 3 ") == 1, "epoch 3 must be reported once, by the attempt that restored"

    run_dir = storage / "ft"
    state = _run_state(run_dir)
    assert state["status"] == "finished"
    assert state["failure_counts"] == {"worker": 1}
    first, second = state["attempts"]
    assert first["outcome"] == "failed" and first["restored_from"] is None
    root = first["failures"][0]
    assert (root["rank"], root["exc_type"]) == (1, "RuntimeError")
    assert second["outcome"] == "finished"
    assert second["restored_from"] is not None and second["restored_from"].startswith("checkpoint_001_")

    # The run's latest checkpoint holds the last epoch.
    latest = torch.load(run_dir / state["latest_checkpoint"] / "state.pt")
    assert latest["epoch"] == 5


def test_fault_tolerance_worker_without_retries_fails(tmp_path: Path, home: Path) -> None:
    storage = tmp_path / "storage"
    proc = _run("fault_tolerance_worker.py",
                ["--storage_path", str(storage), "--run_name", "no_retry", "--max_failures", "0"], home)
    assert proc.returncode != 0, _explain(proc)
    assert "WorkerGroupError" in proc.stderr, _explain(proc)  # a TrainingFailedError, as Ray raises it
    assert "injected failure on rank 1 at epoch 3" in proc.stderr, _explain(proc)
    assert "finished at epoch" not in proc.stdout

    state = _run_state(storage / "no_retry")
    assert state["status"] == "errored"
    assert len(state["attempts"]) == 1


# ---- examples/checkpoint_save_restore.py ----------------------------------------------------


def test_checkpoint_save_restore_continues_from_saved_epoch(tmp_path: Path, home: Path) -> None:
    import torch

    storage = tmp_path / "storage"
    proc = _run("checkpoint_save_restore.py", ["--storage_path", str(storage), "--run_name", "ckpt"], home)
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout

    # The first attempt saved epochs 0 and 1, then failed; the restore went on at epoch 2.
    assert "restored from checkpoint: continuing at epoch 2" in out, _explain(proc)
    assert "resumed at epoch 2" in out, _explain(proc)
    for epoch in range(5):
        assert out.count(f"epoch {epoch}: loss") == 1, f"epoch {epoch} must be trained exactly once\n{out}"
    assert "latest checkpoint: " in out and "(epoch 4)" in out, _explain(proc)

    # CheckpointConfig(num_to_keep=2): of the five checkpoints only the newest two remain.
    run_dir = storage / "ckpt"
    kept = _checkpoint_dirs(run_dir)
    assert len(kept) == 2, [p.name for p in kept]
    assert f"checkpoints kept on storage (2): {kept[0].name}, {kept[1].name}" in out, _explain(proc)
    epochs = [torch.load(p / "extra_state.pt")["epoch"] for p in kept]
    assert epochs == [3, 4]
    # Result.best_checkpoints lists the same two, with the metrics reported alongside them.
    assert out.count("kept checkpoint of epoch ") == 2, _explain(proc)
    assert "kept checkpoint of epoch 3: " in out and "kept checkpoint of epoch 4: " in out, _explain(proc)
    for p in kept:
        assert {"model.pt", "optimizer.pt", "extra_state.pt"} <= {f.name for f in p.iterdir()}
    state = _run_state(run_dir)
    assert [c["checkpoint_dir"] for c in state["checkpoints"]] == [p.name for p in kept]
    assert state["latest_checkpoint"] == kept[-1].name
    # One failure, the intentional one on rank 0 (rank 1 may also be listed, losing its DDP peer).
    assert state["failure_counts"] == {"worker": 1}
    first, second = state["attempts"]
    assert any(f["rank"] == 0 and f["exc_type"] == "RuntimeError"
               and "intentional failure after epoch 1" in (f["message"] or "") for f in first["failures"]), first
    assert second["outcome"] == "finished"


# ---- examples/entrypoint.py -----------------------------------------------------------------


def _wait_for_checkpoints(run_dir: Path, count: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the driver exited early with code {proc.returncode}"
        try:
            if len(_run_state(run_dir)["checkpoints"]) >= count:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"no {count} committed checkpoints in {run_dir} after {timeout_s:.0f} s")


def test_entrypoint_resumes_after_driver_is_killed(tmp_path: Path, home: Path) -> None:
    storage = tmp_path / "storage"
    run_name = "unique_run_id=da823d5"
    args = ["--storage_path", str(storage), "--run_name", run_name, "--num_epochs", "10", "--epoch_seconds", "0.5"]
    run_dir = storage / run_name
    first_log = tmp_path / "first_driver.log"

    # First launch: let it commit two checkpoints, then kill the driver outright.
    with open(first_log, "w") as log:
        first = subprocess.Popen([sys.executable, str(EXAMPLES / "entrypoint.py"), *args], cwd=REPO,
                                 env=_env(home), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_for_checkpoints(run_dir, 2, first, timeout_s=TIMEOUT_S)
            # The embedded node agent, its fork server and the workers: all must go with the driver.
            descendants = psutil.Process(first.pid).children(recursive=True)
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, f"processes outlived the killed driver: {alive}"

    before = _run_state(run_dir)
    assert before["status"] == "running", "a killed driver cannot have recorded an end"
    last_saved = max(c["metrics"]["epoch"] for c in before["checkpoints"])
    assert last_saved < 9, f"the first driver finished before it was killed:\n{first_log.read_text()}"

    # Second launch, the very same command: it resumes right after the last committed epoch.
    proc = _run("entrypoint.py", args, home)
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout
    assert f"resuming from the checkpoint of epoch {last_saved}" in out, _explain(proc)
    assert f"the last attempt started at epoch {last_saved + 1}" in out, _explain(proc)
    assert "finished at epoch 9" in out, _explain(proc)
    trained = [e for e in range(10) if f"epoch {e} done" in out]
    assert trained == list(range(last_saved + 1, 10)), f"the relaunched driver must not start over\n{out}"

    after = _run_state(run_dir)
    assert after["status"] == "finished"
    assert len(after["attempts"]) == 2
    assert after["attempts"][1]["restored_from"] == before["latest_checkpoint"]
    # A driver restart is not a worker failure: it does not use up max_failures.
    assert after["failure_counts"].get("worker", 0) == 0

    # Third launch of the same command, after the run finished: nothing is trained again.
    again = _run("entrypoint.py", args, home)
    assert again.returncode == 0, _explain(again)
    assert "done (loss" not in again.stdout, _explain(again)
    assert "finished at epoch 9" in again.stdout, _explain(again)
    assert len(_run_state(run_dir)["attempts"]) == 2


def test_preemption_jit_checkpoint_moves_to_the_spare_node_drained_with_the_cli(tmp_path, monkeypatch):
    from outlast.testing import LocalCluster

    storage = tmp_path / "storage"
    with LocalCluster(num_nodes=2) as cluster:
        env = {**_env(tmp_path / "home"), "OUTLAST_ADDRESS": cluster.head_address,
               "OUTLAST_CLUSTER_KEY": str(cluster.key_file)}
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "preemption_jit_checkpoint.py"), "--storage_path", str(storage),
             "--run_name", "jit", "--steps", "120", "--step_s", "0.05", "--checkpoint_every", "20"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            state_file = storage / "jit" / "run_state.json"
            deadline = time.monotonic() + TIMEOUT_S
            while not (state_file.exists() and json.loads(state_file.read_text())["latest_checkpoint"]):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                time.sleep(0.2)
            busy = [n.node_id for n in cluster.node_table() if n.used]
            assert len(busy) == 1
            drained = subprocess.run([sys.executable, "-m", "outlast.cli.main", "drain-node", "--node-id", busy[0],
                                      "--reason", "preemption", "--reason-message", "spot reclaim",
                                      "--deadline-remaining-seconds", "30"],
                                     cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
            assert drained.returncode == 0, drained.stderr
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        finally:
            proc.kill()
        assert proc.returncode == 0, out
        # What the workers print reaches the driver, each line prefixed with its rank, node and attempt.
        assert f"[rank 0 {busy[0]} a1] " in out
        assert f"nodes ['{busy[0]}'] (ranks [0, 1]) are being preempted; saving a checkpoint now" in out
        state = json.loads(state_file.read_text())
        assert state["status"] == "finished" and state["failure_counts"] == {"preemption": 1}
        jit = [c for c in state["checkpoints"] if c["metrics"].get("preempted")]
        assert len(jit) == 1 and jit[0]["attempt"] == 1
        assert state["attempts"][1]["restored_from"] == jit[0]["checkpoint_dir"]  # no step lost
        assert not [n for n in cluster.node_table() if n.node_id == busy[0] and n.used]


def test_the_readme_demo_recovers_from_its_killed_rank_and_finishes(home: Path, tmp_path: Path):
    # `./scripts/demo` runs this script: a newcomer's first command must do what the README says.
    storage = tmp_path / "storage"
    proc = _run("ddp_demo.py", ["--steps", "60", "--checkpoint-every", "20", "--kill-step", "30",
                                "--storage-path", str(storage)], home)
    assert proc.returncode == 0, _explain(proc)
    assert "killing rank 1" in proc.stdout and "restored the checkpoint of step 19" in proc.stdout, _explain(proc)
    assert "attempt 2: finished, restored from checkpoint_001_000019" in proc.stdout, _explain(proc)
    assert "goodput: " in proc.stdout and "steps trained again" in proc.stdout, _explain(proc)  # steps 20 to 29
    assert "restarts" in proc.stdout and "checkpoint stalls" in proc.stdout, _explain(proc)
    state = _run_state(storage / "ddp_demo")
    assert state["status"] == "finished" and len(state["attempts"]) == 2


@pytest.mark.parametrize("workers,shards,fsdp", [(2, 1, False), (4, 2, False), (4, 2, True)],
                         ids=["plain", "shards", "fsdp2"])
def test_live_recovery_loses_no_step_and_keeps_the_other_rank_running(home: Path, tmp_path: Path, workers: int,
                                                                      shards: int, fsdp: bool):
    storage = tmp_path / "storage"
    proc = _run("live_recovery.py", ["--storage_path", str(storage), "--workers", str(workers), "--shards",
                                     str(shards)] + (["--fsdp"] if fsdp else []), home)
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout
    assert out.count("training from step 0") == workers and "[rank 0 pid" in out, _explain(proc)
    assert "training from step 20" in out and "finished: {'step': 39" in out, _explain(proc)
    state = _run_state(storage / "live")
    assert state["status"] == "finished" and len(state["attempts"]) == 1 and state["failure_counts"] == {"worker": 1}
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and recovery["ranks"] == [0] and recovery["steps_lost"] == (1 if fsdp else 0)
    assert [c["metrics"]["step"] for c in state["checkpoints"]] == [9, 19, 29, 39]  # saved in parts, committed
    newest = storage / "live" / state["checkpoints"][-1]["checkpoint_dir"]
    assert sorted(p.name for p in newest.glob("optimizer*")) == \
        (["optimizer.pt"] if shards == 1 else ["optimizer-shard-0-of-2.pt", "optimizer-shard-1-of-2.pt"])
    assert sorted(p.name for p in newest.glob("model*")) == \
        (["model-shard-0-of-2.pt", "model-shard-1-of-2.pt"] if fsdp else ["model.pt"])
