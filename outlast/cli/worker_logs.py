"""`outlast runs STORAGE NAME --logs RANK`: a rank's last lines, from the file its node kept.

The run's history names each rank's output file per attempt (node and path); the file is read
where it is, so this works after the rank, its driver and its node's agent are gone, on the
node itself or wherever its log directory is shared.
"""

from __future__ import annotations

import os
import sys

from outlast.cli.documents import LogsDocument, to_json
from outlast.storage.records import CorruptDocument, OutputFile, RunState
from outlast.storage.run_store import RunStore

BLOCK = 64 << 10


def find_output(state: RunState, rank: int, attempt: int | None) -> tuple[int, OutputFile] | None:
    """The rank's output file of `attempt`, or of the latest attempt that has one."""
    for a in reversed(state.attempts):
        if attempt is not None and a.attempt != attempt:
            continue
        for out in reversed(a.outputs):
            if out.rank == rank:
                return a.attempt, out
    return None


def last_lines(path: str, n: int) -> list[str]:
    """The last `n` lines of a file, read backwards from its end in blocks."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        data, pos = b"", end
        while pos > 0 and data.count(b"\n") <= n:
            step = min(BLOCK, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[-n:] if n > 0 else []


def show_logs(store: RunStore, rank: int, attempt: int | None, n: int, as_json: bool = False) -> int:
    try:
        state = store.load_state()
    except CorruptDocument as e:
        print(str(e), file=sys.stderr)
        return 1
    if state is None:
        print(f"no run at {store.storage.uri(store.run_dir)}", file=sys.stderr)
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
        lines = last_lines(out.path, n)
    except OSError as e:
        print(f"rank {rank}'s output of attempt {number} is kept on node {out.node_id} at {out.path}, which cannot "
              f"be read here ({e.strerror}): run this command on that node", file=sys.stderr)
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
