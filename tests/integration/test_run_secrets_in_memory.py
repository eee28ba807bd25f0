"""No byte of one run's secrets is in a process that later forks another run's worker.

Two runs on one node that outlives them: run A's rank stays alive, holding its run's credential,
with a train function (pickled by value from its driver's script) that carries a marker. Run B's
rank is a spare the fork server forked after A's rank; it scans its own whole address space for
A's credential and marker, and the test scans the fork server's too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil

from outlast.procutil import FORK_SERVER_MODULE
from outlast.testing import LocalCluster
from outlast.train import RunConfig, ScalingConfig, Trainer
from tests.integration.memory_scan import scan, scan_own_memory, shifted
from tests.integration.procs import wait_until
from tests.integration.standby_jobs import traced

RUN_A = '''
import json, os, pathlib, sys, time
from outlast.train import RunConfig, ScalingConfig, Trainer

def hold_the_run(config):
    marker = "MARKER"
    out = pathlib.Path(config["out"])  # written whole, then renamed: the test reads it as soon as it exists
    out.with_suffix(".tmp").write_text(json.dumps({
        "pid": os.getpid(), "credential": os.environ["OUTLAST_RUN_CREDENTIAL"], "marker": len(marker)}))
    os.replace(out.with_suffix(".tmp"), out)
    while not os.path.exists(config["release"]):
        time.sleep(0.05)

Trainer(hold_the_run, train_loop_config={"out": sys.argv[1], "release": sys.argv[2]},
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(name="run-a", storage_path=sys.argv[3])).fit()
'''


def test_a_spare_forked_after_another_runs_worker_holds_none_of_that_runs_credential_or_code(
        tmp_path, storage_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_TRACE_FILE", str(tmp_path / "trace.jsonl"))  # which child is a spare
    root = Path(__file__).resolve().parents[2]
    marker = f"outlast-marker-{uuid.uuid4().hex}"
    script = tmp_path / "run_a.py"
    script.write_text(RUN_A.replace("MARKER", marker))
    a_out, release = tmp_path / "a.json", tmp_path / "release"
    with LocalCluster(num_nodes=1, preload=[]) as cluster:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
        run_a = subprocess.Popen([sys.executable, str(script), str(a_out), str(release), storage_path],
                                 cwd=root, env=env)
        try:
            wait_until(lambda: a_out.exists() or run_a.poll() is not None, 300, "run A's rank")
            a = json.loads(a_out.read_text())
            needles = {"run A's credential": shifted(a["credential"].split(" ", 1)[1].encode()),
                       "run A's train function": shifted(marker.encode())}
            # The server forks its spares once the forks asked of it are made: B's rank, asked for at once, could be
            # forked on demand (as A's was) before any spare exists. B is asked for once one does.
            a_forked = next(e["t"] for e in traced("zygote.fork") + traced("zygote.spare") if e["child"] == a["pid"])
            wait_until(lambda: any(e["t"] > a_forked for e in traced("zygote.spare")), 60,
                       "a spare forked after run A's rank")
            b_out = tmp_path / "b.json"
            Trainer(scan_own_memory, train_loop_config={"needles": needles, "out": str(b_out)},
                    scaling_config=ScalingConfig(num_workers=1),
                    run_config=RunConfig(name="run-b", storage_path=storage_path)).fit()
            b = json.loads(b_out.read_text())

            # B's rank was a spare forked after A's rank, so it began as a copy of the server as it was then.
            trace = traced("zygote.fork") + traced("zygote.spare")
            assert any(e["phase"] == "zygote.spare" and e["child"] == b["pid"] and e["t"] > a_forked for e in trace), \
                (a, b, trace)
            assert b["found"].pop("own credential"), b  # the scan sees what the rank holds
            assert b["found"] == {"run A's credential": [], "run A's train function": []}, b

            agent = psutil.Process(cluster.nodes["node-0"].proc.pid)
            servers = [p for p in agent.children() if FORK_SERVER_MODULE in p.cmdline()]
            assert servers
            for server in servers:
                found, read = scan(server.pid, {**needles, "its own module": shifted(FORK_SERVER_MODULE.encode())})
                assert found.pop("its own module") and read > 0, found
                assert found == {"run A's credential": [], "run A's train function": []}, (server, found)
            assert psutil.pid_exists(a["pid"])  # A's rank ran all along
        finally:
            release.touch()
            assert run_a.wait(timeout=120) == 0
