"""Worker output: the agent's bounded reading of each rank's file, and the driver's printer
(order, prefixes, lines not shown counted and said)."""

from __future__ import annotations

import io
import os

from outlast.agent import output as out
from outlast.agent.output import OutputTails, last_lines, output_path, read_output
from outlast.cli.worker_logs import find_output
from outlast.controller.output import OutputPrinter
from outlast.protocol import messages as m
from outlast.storage.records import AttemptRecord, OutputFile, RunState


def _tails(tmp_path, forward=True):
    tails = OutputTails("node-1", tmp_path)
    path = tails.watch("run", 1, 0, output_path(tmp_path, "name", "run", 1, 0), forward)
    return tails, path


def _append(path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_new_lines_are_read_in_order_and_a_partial_line_waits_for_its_newline(tmp_path):
    tails, path = _tails(tmp_path)
    assert tails.read_all() == []
    _append(path, "one\ntwo\nthr")
    [msg] = tails.read_all()
    assert (msg.seq, msg.lines, msg.node_id, msg.attempt, msg.rank) == (0, ["one", "two"], "node-1", 1, 0)
    _append(path, "ee\n")
    [msg] = tails.read_all()
    assert (msg.seq, msg.lines) == (2, ["three"])


def test_a_last_line_without_a_newline_is_sent_when_the_rank_exits(tmp_path):
    tails, path = _tails(tmp_path)
    _append(path, "a\nlast words")
    msgs = tails.finish("run", 1, 0)
    assert [line for msg in msgs for line in msg.lines] == ["a", "last words"]
    assert tails.read_all() == [] and tails.finish("run", 1, 0) == []


def test_a_file_far_behind_is_skipped_to_its_end_and_the_skipped_lines_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(out, "MAX_BEHIND_BYTES", 1000)
    monkeypatch.setattr(out, "READ_BYTES", 100)
    tails, path = _tails(tmp_path)
    _append(path, "".join(f"{i:09d}\n" for i in range(500)))  # 10 bytes a line
    msgs = []
    while batch := tails.read_all():
        msgs += batch
    shown = [line for msg in msgs for line in msg.lines]
    assert shown[-1] == f"{499:09d}"
    assert msgs[0].seq > 0  # the skipped lines come before the first shown
    assert msgs[0].seq + len(shown) == 500  # every line is either shown or counted
    assert tails.skipped_lines == msgs[0].seq
    assert all(len(line) == 9 for line in shown)  # no cut line is shown


def test_a_line_longer_than_the_limit_is_sent_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(out, "MAX_LINE_BYTES", 10)
    tails, path = _tails(tmp_path)
    _append(path, "x" * 25)
    [msg] = tails.read_all()
    assert msg.lines == ["x" * 25]


def test_output_not_forwarded_is_kept_in_its_file_and_never_read(tmp_path):
    tails, path = _tails(tmp_path, forward=False)
    _append(path, "a\nb\n")
    assert tails.read_all() == [] and tails.finish("run", 1, 0) == []
    assert os.path.getsize(path) == 4


def _msg(seq, lines, rank=1, attempt=3, node="node-2"):
    return m.WorkerOutput(run_id="r", attempt=attempt, rank=rank, node_id=node, seq=seq, lines=lines)


def test_the_printer_prefixes_every_line_with_rank_node_and_attempt():
    buf = io.StringIO()
    p = OutputPrinter(stream=lambda: buf)
    p(_msg(0, ["hello", "world"]))
    p.close()
    assert buf.getvalue() == "[rank 1 node-2 a3] hello\n[rank 1 node-2 a3] world\n"


def test_the_printer_without_prefix_prints_the_lines_alone():
    buf = io.StringIO()
    p = OutputPrinter(prefixed=False, stream=lambda: buf)
    p(_msg(0, ["hello"]))
    p.close()
    assert buf.getvalue() == "hello\n"


def test_a_gap_in_the_sequence_is_counted_and_said():
    buf = io.StringIO()
    p = OutputPrinter(stream=lambda: buf)
    p(_msg(0, ["a"]))
    p(_msg(6, ["g"]))
    p.close()
    lines = buf.getvalue().splitlines()
    assert lines[0].endswith("] a") and lines[2].endswith("] g")
    assert "5 line(s) of rank 1 (attempt 3) not shown" in lines[1] and "--logs 1" in lines[1]
    assert p.not_shown == 5


class _Blocked(io.StringIO):
    """A terminal that takes nothing until released."""

    def __init__(self):
        super().__init__()
        import threading
        self.release = threading.Event()

    def write(self, s):
        self.release.wait()
        return super().write(s)


def test_a_full_queue_drops_lines_counts_them_and_never_blocks_the_caller():
    term = _Blocked()
    p = OutputPrinter(stream=lambda: term, max_queued=10)
    for i in range(100):
        p(_msg(i * 5, [f"{i}.{j}" for j in range(5)]))
    term.release.set()
    p.close()
    text = term.getvalue()
    shown = [line for line in text.splitlines() if "not shown" not in line]
    assert 0 < len(shown) < 500
    assert p.not_shown == 500 - len(shown)


def test_logs_are_found_for_the_latest_attempt_or_the_one_asked_for(tmp_path):
    state = RunState(name="n", status="errored", created_at=0, updated_at=0, attempts=[
        AttemptRecord(attempt=1, started_at=0, outputs=[OutputFile(rank=1, node_id="a", path="/1")]),
        AttemptRecord(attempt=2, started_at=1, outputs=[OutputFile(rank=0, node_id="b", path="/2")]),
    ])
    assert find_output(state, 1, None) == (1, OutputFile(rank=1, node_id="a", path="/1"))
    assert find_output(state, 0, 2)[1].path == "/2"
    assert find_output(state, 0, 1) is None


def test_last_lines_reads_back_from_the_end(tmp_path):
    f = tmp_path / "log"
    f.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert last_lines(str(f), 3) == ["line 99997", "line 99998", "line 99999"]
    assert last_lines(str(f), 0) == []


def test_run_config_takes_the_three_output_modes_and_refuses_others():
    import pytest

    from outlast.train import RunConfig

    for mode in ("prefixed", "plain", "off"):
        assert RunConfig(worker_output=mode).worker_output == mode
    assert RunConfig().worker_output == "prefixed"
    with pytest.raises(ValueError, match="worker_output must be one of 'prefixed', 'plain', 'off'"):
        RunConfig(worker_output="loud")


def test_a_node_reads_out_its_own_output_files_and_nothing_else(tmp_path):
    logs = tmp_path / "logs"
    (logs / "run-x").mkdir(parents=True)
    (logs / "run-x" / "attempt1-rank0.log").write_text("a\nb\nc\n")
    (tmp_path / "secret").write_text("no\n")
    reply = read_output(logs, m.ReadOutput(path=str(logs / "run-x" / "attempt1-rank0.log"), lines=2))
    assert reply.lines == ["b", "c"] and reply.error == ""
    refused = read_output(logs, m.ReadOutput(path=str(logs / ".." / "secret"), lines=2))
    assert refused.lines == [] and "is not an output file of this node" in refused.error
    missing = read_output(logs, m.ReadOutput(path=str(logs / "run-x" / "gone.log"), lines=2))
    assert missing.lines == [] and "cannot read" in missing.error


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_lines_are_written_over_a_progress_line():
    term = _Terminal()
    term.write("waiting for capacity: ...")  # a progress line, no newline
    p = OutputPrinter(stream=lambda: term)
    p(_msg(0, ["hello"]))
    p.close()
    assert term.getvalue() == "waiting for capacity: ...\r\x1b[K[rank 1 node-2 a3] hello\n"


def _writer(path):
    """A rank's stdout as the fork server opens it: appending, held open while the agent truncates."""
    return os.open(path, os.O_WRONLY | os.O_APPEND)


def test_a_file_past_its_cap_is_truncated_and_the_lines_lost_are_a_gap(tmp_path, monkeypatch):
    monkeypatch.setenv(out.MAX_FILE_BYTES_VAR, str(2 * out.READ_BYTES))
    tails, path = _tails(tmp_path)
    fd = _writer(path)
    try:
        os.write(fd, b"first\n")
        [msg] = tails.read_all()
        assert (msg.seq, msg.lines) == (0, ["first"])
        line = b"x" * 99 + b"\n"
        lines = (2 * out.READ_BYTES) // 100 + 10  # past the cap before the agent's next turn
        os.write(fd, line * lines)
        [msg] = tails.read_all()
        assert os.path.getsize(path) < out.READ_BYTES  # cut: the disk is not filled
        assert msg.seq == 1 + lines and msg.lines == []  # every unread line lost, counted as a gap
        os.write(fd, b"after\n")  # the rank's descriptor appends: it writes on from the start
        [msg] = tails.read_all()
        assert (msg.seq, msg.lines) == (1 + lines, ["after"])
        buf = io.StringIO()
        printer = OutputPrinter(stream=lambda: buf)
        printer(m.WorkerOutput(run_id="run", attempt=1, rank=0, node_id="node-1", seq=0, lines=["first"]))
        printer(msg)
        printer.close()
        assert f"{lines} line(s) of rank 0 (attempt 1) not shown" in buf.getvalue()
        assert "past its size cap" in buf.getvalue()
    finally:
        os.close(fd)


def test_a_file_not_forwarded_is_capped_too(tmp_path, monkeypatch):
    monkeypatch.setenv(out.MAX_FILE_BYTES_VAR, str(2 * out.READ_BYTES))
    tails, path = _tails(tmp_path, forward=False)
    fd = _writer(path)
    try:
        os.write(fd, b"y" * (2 * out.READ_BYTES + 1))
        assert tails.read_all() == []
        assert os.path.getsize(path) == 0
    finally:
        os.close(fd)


def test_a_cap_that_is_not_a_number_of_bytes_is_refused_saying_what_to_write():
    import pytest

    for bad in ("lots", "100"):
        with pytest.raises(ValueError, match=f"{out.MAX_FILE_BYTES_VAR}='{bad}': give a whole number of bytes"):
            out.max_file_bytes({out.MAX_FILE_BYTES_VAR: bad})
