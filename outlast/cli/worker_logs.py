"""`outlast runs STORAGE NAME --logs RANK`: a rank's last lines, from the file its node kept.

The run's history names each rank's output file per attempt (node and path). A history is data:
the path is used only when it has the shape of the file outlast writes for that rank and attempt
(`LOG_DIR/NAME-RUN_ID/attemptA-rankR.log`, outlast/agent/output.py). Such a file under this
machine's own log directory is read here, without following a link; that works after the rank,
its driver and its node's agent are gone. Otherwise its node's agent is asked for the lines,
through the cluster this machine belongs to, and reads only under its own log directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import zmq

from outlast.agent.output import output_path
from outlast.cli.confined import Refused, open_under, tail_lines
from outlast.cli.documents import LogsDocument, to_json
from outlast.client.discovery import AgentUnavailable, find_running_agent, request
from outlast.protocol import messages as m
from outlast.statedir import default_state_dir
from outlast.storage.records import CorruptDocument, NewerVersionError, OutputFile, RunState
from outlast.storage.run_store import RunStore

MAX_TAIL_BYTES = 16 << 20  # of a rank's file, read from its end: a page of lines, never the whole file


def local_log_dir() -> Path:
    """Where the agent on this machine writes its ranks' output (outlast/agent/agent.py), not created here."""
    return default_state_dir() / "logs"


def checked_output_path(name: str, attempt: int, out: OutputFile) -> tuple[str, str]:
    """The log directory and the file's path inside it, when the history names the file outlast writes
    for that rank and attempt; `Refused`, saying so, for any other path."""
    path = out.path
    expected = output_path(Path("/"), name, "RUN_ID", attempt, out.rank)
    parts = path.split("/")
    if (not path.startswith("/") or "\x00" in path or os.path.normpath(path) != path or len(parts) < 4
            or parts[-1] != expected.name or not parts[-2].startswith(f"{name}-")):
        raise Refused(f"the history of run {name} names {path!r} as rank {out.rank}'s output of attempt {attempt}, "
                      f"which is not a file outlast writes (LOG_DIR/{name}-RUN_ID/{expected.name}): it is not read")
    return "/".join(parts[:-2]), "/".join(parts[-2:])


def read_here(name: str, attempt: int, out: OutputFile, n: int, log_dir: Path) -> list[str] | None:
    """The file's last `n` lines when it lies in this machine's log directory; None when it is not here
    (its node is asked). `Refused` for a path outlast does not write, or a link in its place."""
    where, rel = checked_output_path(name, attempt, out)
    if where not in {str(log_dir), os.path.realpath(log_dir)}:
        return None
    try:
        fd = open_under(Path(os.path.realpath(log_dir)), rel)
    except FileNotFoundError:
        return None
    try:
        return tail_lines(fd, n, MAX_TAIL_BYTES)[0]
    finally:
        os.close(fd)


def find_output(state: RunState, rank: int, attempt: int | None) -> tuple[int, OutputFile] | None:
    """The rank's output file of `attempt`, or of the latest attempt that has one."""
    for a in reversed(state.attempts):
        if attempt is not None and a.attempt != attempt:
            continue
        for out in reversed(a.outputs):
            if out.rank == rank:
                return a.attempt, out
    return None


def from_its_node(out: OutputFile, n: int) -> list[str]:
    """Ask the node that kept the file, through this machine's cluster (its head's node table)."""
    ctx = zmq.Context()
    try:
        here = find_running_agent(ctx)
        if here is None:
            raise AgentUnavailable("no outlast node runs on this machine to reach the cluster through")
        pong = request(ctx, here, m.Ping(), timeout_s=3.0)
        head = (pong.head_address or here) if isinstance(pong, m.Pong) else here
        table = request(ctx, head, m.ListNodes(), timeout_s=3.0)
        node = next((x for x in getattr(table, "nodes", []) if x.node_id == out.node_id), None)
        if node is None or node.state == "dead":
            raise AgentUnavailable(f"node {out.node_id} is not in the cluster's table, or is dead")
        reply = request(ctx, node.address, m.ReadOutput(path=out.path, lines=n), timeout_s=10.0)
        if not isinstance(reply, m.OutputLines) or reply.error:
            raise AgentUnavailable(getattr(reply, "error", "") or f"node {out.node_id} did not send the lines")
        return reply.lines
    finally:
        ctx.destroy(linger=0)


def load_run(store: RunStore) -> RunState | None:
    """The run's history, or None with what is wrong said on stderr (no run there, or a corrupt document)."""
    try:
        state = store.load_state()
    except (CorruptDocument, NewerVersionError) as e:
        print(str(e), file=sys.stderr)
        return None
    if state is None:
        print(f"no run at {store.storage.uri(store.run_dir)}", file=sys.stderr)
    return state


def show_logs(store: RunStore, rank: int, attempt: int | None, n: int, as_json: bool = False) -> int:
    state = load_run(store)
    if state is None:
        return 1
    found = find_output(state, rank, attempt)
    if found is None:
        which = f"attempt {attempt}" if attempt is not None else "any attempt"
        ranks = sorted({o.rank for a in state.attempts for o in a.outputs})
        print(f"the history of run {state.name} names no output file of rank {rank} in {which} (ranks with one: "
              f"{ranks or 'none'}; the history names a rank's file once it failed, committed or ended)",
              file=sys.stderr)
        return 1
    number, out = found
    try:
        lines = read_here(state.name, number, out, n, local_log_dir())
        if lines is None:
            lines = from_its_node(out, n)
    except (Refused, OSError) as e:
        print(str(e), file=sys.stderr)
        return 1
    except AgentUnavailable as why:
        print(f"rank {rank}'s output of attempt {number} is kept on node {out.node_id} at {out.path}, which is not "
              f"on this machine and cannot be asked of its node ({why}): run this command on that node",
              file=sys.stderr)
        return 1
    if as_json:
        print(to_json(LogsDocument(run=state.name, rank=rank, attempt=number, node_id=out.node_id, path=out.path,
                                   lines=lines)))
        return 0
    print(f"rank {rank}, attempt {number}, node {out.node_id}: the last {len(lines)} line(s) of {out.path}",
          file=sys.stderr)
    for line in lines:
        print(line)
    return 0
