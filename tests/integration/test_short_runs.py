"""Short runs end quietly: a node stopped while its standby fork server still imports its modules
(the common case for a run of a few seconds) prints nothing but the run's own output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DRIVER = """
import sys
from outlast.train import RunConfig, ScalingConfig, Trainer
from tests.integration.standby_jobs import until_standby_loop
result = Trainer(until_standby_loop, scaling_config=ScalingConfig(num_workers=1),
                 run_config=RunConfig(name=sys.argv[1], storage_path=sys.argv[2])).fit()
print("metrics", result.last_metrics)
"""


def test_short_runs_print_no_traceback_to_the_driver_or_the_nodes_logs(tmp_path, storage_path, _isolated_outlast_home):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUTLAST_TRACE_FILE": "", "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for i in range(4):
        env["OUTLAST_TRACE_FILE"] = str(tmp_path / f"trace-{i}.jsonl")
        done = subprocess.run([sys.executable, "-c", DRIVER, f"short-{i}", storage_path], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "metrics {'standby': True}" in done.stdout, done.stdout
        for stream in (done.stdout, done.stderr):
            assert "Traceback" not in stream, stream
    logs = [p for p in Path(_isolated_outlast_home).rglob("*") if p.is_file() and p.suffix in (".log", ".out", ".err")]
    for log in logs:
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, (log, text)
