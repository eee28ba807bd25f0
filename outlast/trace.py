"""Timestamps along the restart path and a SYNC report's, for the benchmarks (bench/restart_breakdown.py,
bench/checkpoint.py), off by default.

With `OUTLAST_TRACE_FILE` set, each `mark(phase, ...)` appends one JSON line (wall time, pid, the
phase and its fields) to that file; every process of a run inherits the variable: the driver,
the agent, the fork server and the workers. Unset, a mark costs one dictionary lookup.
The phases are listed in docs/benchmarks.md ("Where a restart's time goes"); those along a SYNC report's
path (report.*, upload.*, controller.report, controller.committed, tier.*) in bench/lib/checkpoint_probe.py
(`report_phases`).
"""

from __future__ import annotations

import json
import os
import time

ENV_VAR = "OUTLAST_TRACE_FILE"


def mark(phase: str, **fields: object) -> None:
    path = os.environ.get(ENV_VAR)
    if not path:
        return
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "phase": phase, **fields}) + "\n"
    try:
        # One write on an O_APPEND file: lines of concurrent processes never interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # a trace is never worth a failure
