"""No process a rank started outlives the rank: real ranks start real processes, then die.

Each rank starts two sleepers: one with `subprocess.Popen` (in the rank's process group, as a
data loader's worker or a tokenizer server would be), and one that daemonizes (forks twice and
calls `setsid`, so no process group or parent of the rank's holds it any more).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.procs import alive, wait_until

DAEMON = textwrap.dedent("""
    import os, sys, time
    if os.fork():
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(1000)
""")


def start_sleepers(pids_file: str) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    with open(pids_file, "a") as f:
        f.write(f"{sleeper.pid}\n")
    subprocess.run([sys.executable, "-c", DAEMON, pids_file], check=True)  # returns once the first fork exits
    for _ in range(500):  # the daemon writes its pid once it is detached
        if len(Path(pids_file).read_text().split()) >= 2:
            return
        import time

        time.sleep(0.01)
    raise RuntimeError("the daemon did not write its pid")


def sleepers_then_die(config):
    from outlast.train import get_context

    ctx = get_context()
    pids_file = f"{config['dir']}/attempt{ctx.get_attempt()}-rank{ctx.get_world_rank()}.pids"
    start_sleepers(pids_file)
    if ctx.get_attempt() == 1:
        import time

        while len(started(Path(config["dir"]))) < 2 * ctx.get_world_size():  # every rank's sleepers run
            time.sleep(0.01)
        if ctx.get_world_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # the rank dies at once: nothing of its own cleans up
        time.sleep(1000)  # the others are stopped by the restart


def sleepers_then_wait(config):
    from outlast.train import get_context

    start_sleepers(f"{config['dir']}/rank{get_context().get_world_rank()}.pids")
    import time

    time.sleep(1000)


def started(directory: Path) -> list[int]:
    return [int(p) for f in sorted(directory.glob("*.pids")) for p in f.read_text().split()]


def test_what_a_rank_started_dies_with_it_whether_it_was_killed_or_returned(tmp_path, storage_path):
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    try:
        result = Trainer(sleepers_then_die, train_loop_config={"dir": str(pids_dir)},
                         scaling_config=ScalingConfig(num_workers=2),
                         run_config=RunConfig(name="children", storage_path=storage_path,
                                              failure_config=FailureConfig(max_failures=1))).fit()
        assert result.error is None
        pids = started(pids_dir)
        assert len(pids) == 8  # 2 ranks x 2 attempts x (a Popen'd sleeper and a daemon)
        assert [p for p in pids if alive(p)] == []
    finally:
        _kill_left(pids_dir)


def test_a_driver_killed_with_its_embedded_node_leaves_no_process_its_ranks_started(tmp_path, storage_path):
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from outlast.train import RunConfig, ScalingConfig, Trainer
        from tests.integration.test_rank_children import sleepers_then_wait
        Trainer(sleepers_then_wait, train_loop_config={{"dir": {str(pids_dir)!r}}},
                scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(name="killed-driver", storage_path={storage_path!r})).fit()
    """))
    driver = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "OUTLAST_PRELOAD": ""})
    try:
        wait_until(lambda: len(started(pids_dir)) == 4, 120, "both ranks' sleepers")
        pids = started(pids_dir)
        assert all(alive(p) for p in pids)
        driver.kill()
        driver.wait()
        wait_until(lambda: not any(alive(p) for p in pids), 30, f"the sleepers {pids} to die with the driver")
    finally:
        driver.kill()
        driver.wait()
        _kill_left(pids_dir)


def _kill_left(pids_dir: Path) -> None:
    """What a failed run of these tests left (the test's own cleanup, never outlast's)."""
    for p in started(pids_dir):
        if alive(p):
            os.kill(p, signal.SIGKILL)
