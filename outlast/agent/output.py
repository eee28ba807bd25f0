"""Workers' output: each rank writes its stdout and stderr to a file of its own on the node, and
the agent reads the new lines of every file on each turn of its loop and forwards them to the
run's controller as `WorkerOutput` (docs/architecture.md, "Worker output").

A file, not a pipe: the rank never waits for the agent (a full pipe would stop a fast writer's
loop), the lines are kept after the rank and the agent are gone (`outlast runs --logs`), and one
file for both streams keeps the order in which the rank wrote them. The agent's reading is
bounded: at most `READ_BYTES` per file per turn, and a file more than `MAX_BEHIND_BYTES` ahead of
its reader is skipped to its end, the lines skipped counted in the sequence numbers so the
driver can say how many it did not show.

A file is also capped (`OUTLAST_WORKER_OUTPUT_MAX_BYTES`, 1 GiB): a rank printing in a loop
must not fill the node's disk. Past the cap the agent truncates it to nothing; the rank's
descriptor appends, so it writes on from the start. What the agent had not read yet is lost,
counted as skipped lines like the rest (a gap in the line numbers the driver says), and said in
the agent's log. Truncation, not rotation: the rank holds the file open, so a renamed file would
go on growing under its new name.
"""

from __future__ import annotations

import io
import logging

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from outlast.agent.log_retention import prune
from outlast.protocol import messages as m

READ_BYTES = 1 << 20  # per file per turn of the loop: one message stays small
MAX_BEHIND_BYTES = 32 << 20  # further behind than this, the reader skips to the end
MAX_LINE_BYTES = 64 << 10  # a longer line without a newline is cut and sent in pieces
MAX_FILE_BYTES_VAR = "OUTLAST_WORKER_OUTPUT_MAX_BYTES"
DEFAULT_MAX_FILE_BYTES = 1 << 30


def max_file_bytes(env: Mapping[str, str] = os.environ) -> int:
    """The cap on a rank's output file; a bad value is refused saying what to write."""
    text = env.get(MAX_FILE_BYTES_VAR, "")
    if not text:
        return DEFAULT_MAX_FILE_BYTES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 2 * READ_BYTES:
        raise ValueError(f"{MAX_FILE_BYTES_VAR}={text!r}: give a whole number of bytes, at least {2 * READ_BYTES} "
                         f"(default {DEFAULT_MAX_FILE_BYTES})")
    return value

log = logging.getLogger("outlast.agent")


def output_path(log_dir: Path, run_name: str, run_id: str, attempt: int, rank: int) -> Path:
    return log_dir / f"{run_name}-{run_id}" / f"attempt{attempt}-rank{rank}.log"


def task_output_path(log_dir: Path, session: str, task_id: str) -> Path:
    """An Executor task's file: one directory per executor (its session), one file per task."""
    return log_dir / session / f"task-{task_id}.log"


def last_lines(path: str, n: int) -> list[str]:
    """The last `n` lines of a file, read backwards from its end in blocks."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        data, pos = b"", end
        while pos > 0 and data.count(b"\n") <= n:
            step = min(READ_BYTES, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[-n:] if n > 0 else []


def read_output(log_dir: Path, req: m.ReadOutput) -> m.OutputLines:
    """Answer `ReadOutput`, for a file under this node's log directory only."""
    try:
        path = os.path.realpath(req.path)
    except ValueError:  # a NUL byte: no file has that name
        return m.OutputLines(path=req.path, lines=[], error=f"{req.path!r} is not a path")
    if os.path.commonpath([path, os.path.realpath(log_dir)]) != os.path.realpath(log_dir):
        return m.OutputLines(path=req.path, lines=[], error=f"{req.path} is not an output file of this node")
    try:
        return m.OutputLines(path=req.path, lines=last_lines(path, max(0, min(req.lines, 100_000))))
    except OSError as e:
        return m.OutputLines(path=req.path, lines=[], error=f"cannot read {req.path}: {e.strerror}")


def redirect_to(path: str) -> None:
    """In a freshly forked worker: stdout and stderr (fd 1 and 2, C code's too) append to `path`.

    Python's streams are line-buffered so each line reaches the file as it is printed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # what the fork server had buffered is its own, not the worker's
        except Exception:
            pass
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if not isinstance(stream, io.TextIOWrapper):
            continue  # replaced by something that buffers as it likes
        try:
            stream.reconfigure(line_buffering=True)
        except ValueError:
            pass


@dataclass
class _Tail:
    run_id: str
    attempt: int
    rank: int
    path: str
    fd: int
    task_id: str = ""
    offset: int = 0
    seq: int = 0  # lines read so far, skipped ones included
    partial: bytes = b""
    skipping_fragment: bool = False  # after a skip: the rest of a cut line is part of what was skipped
    forward: bool = True  # False: only capped, never read (RunConfig(worker_output="off"))


class OutputTails:
    """The output files of the workers on this node, read from where each was left."""

    def __init__(self, node_id: str, log_dir: Path) -> None:
        self.node_id = node_id
        self.log_dir = log_dir  # each rank's output, per run and attempt
        self._tails: dict[tuple[str, int, int, str], _Tail] = {}  # (run, attempt, rank, task id)
        self.skipped_lines = 0  # over the node's life, for its log and metrics
        self.max_file_bytes = max_file_bytes()
        self._run_dirs: dict[str, str] = {}  # run id -> its directory, until the run ends (read or not)
        self.prune()  # what earlier agents of this node left

    def file_for(self, req: m.SpawnWorkers, rank: int) -> str:
        """The rank's output file, watched from its first byte; "" (its output goes to the node's log
        instead) when the file cannot be made."""
        try:
            return self.watch(req.run_id, req.attempt, rank,
                              output_path(self.log_dir, req.run_name, req.run_id, req.attempt, rank), req.forward_output)
        except OSError as e:
            log.error("could not create the output file of rank %d under %s (%s)", rank, self.log_dir, e)
            return ""

    def file_for_task(self, req: m.SpawnTask) -> str:
        """As `file_for`, for an Executor task (attempt 0, rank -1, as the fork server names it)."""
        try:
            return self.watch(req.run_id, 0, -1, task_output_path(self.log_dir, req.run_id, req.task_id), True,
                              req.task_id)
        except OSError as e:
            log.error("could not create the output file of task %s under %s (%s)", req.task_id, self.log_dir,
                      e)
            return ""

    def watch(self, run_id: str, attempt: int, rank: int, path: Path, forward: bool, task_id: str = "") -> str:
        """Create the rank's file (before its fork, so that reading starts at its first byte)."""
        self.finish(run_id, attempt, rank, task_id)  # a spawn sent again for the same rank starts over
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._run_dirs[run_id] = path.parent.name
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        # RunConfig(worker_output="off"): kept in the file, never read here, but capped all the same.
        self._tails[(run_id, attempt, rank, task_id)] = _Tail(run_id, attempt, rank, str(path), fd,
                                                              offset=os.fstat(fd).st_size, task_id=task_id,
                                                              forward=forward)
        return str(path)

    def read_all(self) -> list[m.WorkerOutput]:
        """The new lines of every file, one message per file that has any."""
        out = []
        for t in self._tails.values():
            msg = self._read(t, final=False)
            if msg is not None:
                out.append(msg)
        return out

    def finish(self, run_id: str, attempt: int, rank: int, task_id: str = "") -> list[m.WorkerOutput]:
        """The rank exited: its last lines (a last line without a newline too), then stop reading."""
        t = self._tails.pop((run_id, attempt, rank, task_id), None)
        if t is None:
            return []
        out = []
        try:
            while t.forward and (msg := self._read(t, final=True)) is not None:
                out.append(msg)
                if len(msg.lines) == 0:
                    break
        finally:
            os.close(t.fd)
        return out

    def finish_run(self, run_id: str) -> list[m.WorkerOutput]:
        out = []
        for key in [k for k in self._tails if k[0] == run_id]:
            out += self.finish(*key)
        self._run_dirs.pop(run_id, None)
        self.prune()
        return out

    def prune(self) -> None:
        """Remove old runs' files (outlast/agent/log_retention.py), never those still read here."""
        prune(self.log_dir, time.time(), set(self._run_dirs.values()))

    def close(self) -> None:
        for t in self._tails.values():
            os.close(t.fd)
        self._tails.clear()

    def _read(self, t: _Tail, final: bool) -> m.WorkerOutput | None:
        try:
            size = os.fstat(t.fd).st_size
        except OSError:
            return None
        skipped = 0
        if size > self.max_file_bytes:
            skipped, size = self._cap(t, size)
        if not t.forward:
            return None
        if size < t.offset:  # truncated by someone: start again from its start
            t.offset, t.partial = 0, b""
        if size - t.offset > MAX_BEHIND_BYTES:
            skipped = self._skip(t, size - READ_BYTES)
        data = os.pread(t.fd, min(size - t.offset, READ_BYTES), t.offset) if size > t.offset else b""
        t.offset += len(data)
        if not data and not (final and t.partial) and not skipped:
            return None
        if t.skipping_fragment:
            cut = data.find(b"\n")
            if cut < 0:
                return self._message(t, [], skipped) if skipped else None
            data, t.skipping_fragment = data[cut + 1:], False
        pieces = (t.partial + data).split(b"\n")
        t.partial = pieces.pop()
        if final and t.offset >= size and t.partial:
            pieces.append(t.partial)
            t.partial = b""
        elif len(t.partial) > MAX_LINE_BYTES:
            pieces.append(t.partial)
            t.partial = b""
        if not pieces and not skipped:
            return None
        return self._message(t, [p.decode("utf-8", "replace") for p in pieces], skipped)

    def _message(self, t: _Tail, lines: list[str], skipped: int) -> m.WorkerOutput:
        t.seq += skipped
        seq = t.seq
        t.seq += len(lines)
        return m.WorkerOutput(run_id=t.run_id, attempt=t.attempt, rank=t.rank, node_id=self.node_id, seq=seq,
                              lines=lines, task_id=t.task_id)

    def _cap(self, t: _Tail, size: int) -> tuple[int, int]:
        """Truncate a file past the cap; returns the lines lost (read or not, they count as skipped:
        the writer may add a few between our look and the cut, not counted) and its new size."""
        lost = self._skip(t, size) if t.forward else 0
        try:
            os.truncate(t.path, 0)
        except OSError as e:
            log.error("could not truncate %s past its cap of %d bytes (%s)", t.path, self.max_file_bytes, e)
            return lost, size
        t.offset = 0
        who = f"task {t.task_id}" if t.task_id else f"rank {t.rank} (attempt {t.attempt})"
        log.warning("the output file of %s passed %s=%d bytes and was truncated; %s", who, MAX_FILE_BYTES_VAR,
                    self.max_file_bytes, f"{lost} line(s) not yet forwarded were lost" if t.forward
                    else "its earlier output is gone")
        try:
            return lost, os.fstat(t.fd).st_size
        except OSError:
            return lost, 0

    def _skip(self, t: _Tail, to: int) -> int:
        """Jump to `to`, counting the lines jumped over (a line cut at `to` counts as one of them)."""
        lines, pos, last = 0, t.offset, b"\n"
        while pos < to:
            chunk = os.pread(t.fd, min(to - pos, READ_BYTES), pos)
            if not chunk:
                break
            lines += chunk.count(b"\n")
            pos, last = pos + len(chunk), chunk[-1:]
        cut = last != b"\n"
        t.offset, t.partial, t.skipping_fragment = pos, b"", cut
        lines += cut
        self.skipped_lines += lines
        return lines
