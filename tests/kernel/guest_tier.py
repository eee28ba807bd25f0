"""The cgroup v2 tier's guest kernel, started as soon as the session knows it will run it.

Booting the guest and running its tests takes minutes, almost all of it on one core and in a
process of its own (user-mode Linux or QEMU), so it runs beside the rest of the session instead
of after it; its test then waits for it and reads what it printed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_ID = "tests/kernel/test_cgroup_v2_guest.py::test_the_real_kernel_tests_pass_on_cgroup_v2_in_a_guest_kernel"


@dataclass
class GuestRun:
    proc: subprocess.Popen
    output: Path
    work: Path  # the guest's root file system, a copy of its own (another session may boot one too)

    def wait(self, timeout_s: float) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        shutil.rmtree(self.work, ignore_errors=True)
        text = self.output.read_text(errors="replace")
        self.output.unlink(missing_ok=True)
        return code, text

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)
        self.output.unlink(missing_ok=True)


_run: GuestRun | None = None


def start() -> GuestRun:
    """The one guest run of this session, started on the first call."""
    global _run
    if _run is None:
        fd, name = tempfile.mkstemp(prefix="outlast-cgroup-v2-", suffix=".log")
        work = Path(tempfile.mkdtemp(prefix="outlast-cgroup-v2-run-"))
        with os.fdopen(fd, "wb") as out:
            proc = subprocess.Popen([str(ROOT / "scripts" / "test-cgroup-v2")], cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, "PYTHON": sys.executable, "WORK": str(work)})
        _run = GuestRun(proc, Path(name), work)
    return _run


def stop() -> None:
    if _run is not None:
        _run.stop()
