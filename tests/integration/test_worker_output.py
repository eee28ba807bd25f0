"""Every rank's output on the driver: two ranks on two `LocalCluster` nodes, at 10,000 lines per
second each, reach the driver's stdout prefixed and complete; a killed rank's last lines are in
`outlast runs --logs` after the fact."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from outlast.cli.main import main as cli_main
from outlast.cli.worker_logs import from_its_node, find_output
from outlast.storage import open_storage
from outlast.storage.run_store import RunStore
from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer, TrainingFailedError, get_context

LINES = 20_000
RATE = 10_000  # lines per second per rank


def chatty_loop(config):
    rank = get_context().get_world_rank()
    start = time.monotonic()
    for i in range(config["lines"]):
        print(f"line {i} of rank {rank}")
        if i % 100 == 99:  # paced at `rate` lines per second
            ahead = start + (i + 1) / config["rate"] - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
    print(f"rank {rank} says goodbye on stderr", file=sys.stderr)


def dying_loop(config):
    rank = get_context().get_world_rank()
    for i in range(50):
        print(f"rank {rank} step {i}")
    if rank == 1:
        print("rank 1's last words", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exited:
        cli_main(argv)
    return exited.value.code


@pytest.fixture
def cluster():
    with LocalCluster(num_nodes=2, node_timeout_s=3) as c:
        yield c


def test_two_ranks_on_two_nodes_reach_the_driver_prefixed_in_order_and_complete(cluster, tmp_path, capsys):
    Trainer(chatty_loop, train_loop_config={"lines": LINES, "rate": RATE},
            scaling_config=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD"),
            run_config=RunConfig(name="chatty", storage_path=str(tmp_path))).fit()
    out = capsys.readouterr().out.splitlines()
    assert not [line for line in out if "not shown" in line]
    pattern = re.compile(r"^\[rank (\d) (node-\d) a1\] (.*)$")
    by_rank: dict[int, list[str]] = {0: [], 1: []}
    nodes: dict[int, set[str]] = {0: set(), 1: set()}
    for line in out:
        if (match := pattern.match(line)):
            rank = int(match.group(1))
            by_rank[rank].append(match.group(3))
            nodes[rank].add(match.group(2))
    for rank in (0, 1):
        expected = [f"line {i} of rank {rank}" for i in range(LINES)] + [f"rank {rank} says goodbye on stderr"]
        assert by_rank[rank] == expected
    assert len(nodes[0]) == len(nodes[1]) == 1 and nodes[0] != nodes[1]  # one node each, not the same


def test_worker_output_off_prints_nothing_of_the_ranks(cluster, tmp_path, capsys):
    Trainer(chatty_loop, train_loop_config={"lines": 10, "rate": RATE},
            scaling_config=ScalingConfig(num_workers=1),
            run_config=RunConfig(name="quiet", storage_path=str(tmp_path), worker_output="off")).fit()
    assert "of rank 0" not in capsys.readouterr().out


def test_a_killed_ranks_last_lines_are_in_outlast_runs_logs(cluster, tmp_path, capsys):
    with pytest.raises(TrainingFailedError):
        Trainer(dying_loop, scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(name="dying", storage_path=str(tmp_path),
                                     failure_config=FailureConfig(max_failures=0))).fit()
    driver = capsys.readouterr().out
    assert "] rank 1's last words" in driver  # seen live on the driver, before the failure
    assert _cli(["runs", str(tmp_path), "dying", "--logs", "1", "--lines", "3"]) == 0
    got = capsys.readouterr()
    assert got.out.splitlines() == ["rank 1 step 48", "rank 1 step 49", "rank 1's last words"]
    assert "rank 1, attempt 1, node node-" in got.err
    assert _cli(["runs", str(tmp_path), "dying", "--logs", "7"]) == 1
    assert "names no output file of rank 7" in capsys.readouterr().err
    # From a machine that cannot read the file: its node's agent sends the lines.
    state = RunStore(open_storage(str(tmp_path)), "dying").load_state()
    _attempt, out = find_output(state, 1, None)
    assert from_its_node(out, 2) == ["rank 1 step 49", "rank 1's last words"]
