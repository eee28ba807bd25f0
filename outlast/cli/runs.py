"""`outlast runs STORAGE_PATH [NAME]`: the runs on storage, and one run's history at a glance."""

from __future__ import annotations

import argparse
import sys
import time

from outlast.storage import goodput, open_storage
from outlast.storage.goodput import Goodput
from outlast.storage.records import RUN_STATE_NAME, CorruptDocument, NewerVersionError, RunState, signal_name
from outlast.storage.run_store import RunStore
from outlast.cli.documents import RunDocument, RunsDocument, RunSummary, to_json
from outlast.cli.worker_logs import load_run, show_logs


def add_parser(sub) -> None:
    p = sub.add_parser("runs", help="list the runs under a storage path, or show one run's history")
    p.add_argument("storage_path", help="a directory or URL (s3://bucket/prefix, ...)")
    p.add_argument("name", nargs="?", help="the run to show in detail")
    p.add_argument("--logs", type=int, default=None, metavar="RANK",
                   help="with NAME: the last lines rank RANK wrote to stdout and stderr (its latest attempt)")
    p.add_argument("--attempt", type=int, default=None, help="with --logs: this attempt instead of the latest")
    p.add_argument("--lines", type=int, default=100, help="with --logs: how many of the last lines (default 100)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document (schemas: docs/schemas/runs.v1.json, run.v1.json, logs.v1.json; "
                        "docs/json.md)")
    p.set_defaults(func=cmd_runs)


def cmd_runs(args: argparse.Namespace) -> int:
    try:
        storage = open_storage(args.storage_path)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    if args.logs is not None and not args.name:
        print("--logs RANK needs the run's NAME: outlast runs STORAGE_PATH NAME --logs RANK", file=sys.stderr)
        return 2
    if args.name and args.logs is not None:
        return show_logs(RunStore(storage, args.name), args.logs, args.attempt, args.lines, as_json=args.json)
    if args.name:
        return _show(RunStore(storage, args.name), args.json)
    runs = summaries(storage)
    if args.json:
        print(to_json(RunsDocument(storage=storage.uri(""), runs=runs)))
        return 0 if runs else 1
    if not runs:
        print(f"no runs under {storage.uri('')}")
        return 1
    print(f"{'run':32} {'status':10} {'attempts':>8} {'failures':>8} {'checkpoints':>11}  latest")
    for r in runs:
        if r.unreadable:
            print(f"{r.name:32} unreadable: {r.unreadable}")
        else:
            print(f"{r.name:32} {r.status:10} {r.attempts:>8} {r.failures:>8} {r.checkpoints:>11}  "
                  f"{r.latest_checkpoint or '-'}")
    return 0


def summaries(storage) -> list[RunSummary]:
    out = []
    for name in (n for n in storage.list_dirs("") if storage.exists(f"{n}/{RUN_STATE_NAME}")):
        try:
            state = RunStore(storage, name).load_state()
        except (CorruptDocument, NewerVersionError) as e:
            out.append(RunSummary(name=name, unreadable=str(e)))
            continue
        if state is not None:
            out.append(RunSummary(name=name, status=state.status, attempts=len(state.attempts),
                                  failures=sum(state.failure_counts.values()), checkpoints=len(state.checkpoints),
                                  latest_checkpoint=state.latest_checkpoint, failure_counts=state.failure_counts,
                                  last_metrics=state.last_metrics, updated_at=state.updated_at,
                                  workers=state.attempts[-1].workers if state.attempts else None))
    return out


def _show(store: RunStore, as_json: bool = False) -> int:
    state = load_run(store)
    if state is None:
        return 1
    where = store.storage.uri(store.run_dir)
    held = run_goodput(store, state, time.time())
    print(to_json(RunDocument(location=where, run=state, goodput=held)) if as_json else render(state, where, held))
    return 0


def run_goodput(store: RunStore, state: RunState, now: float) -> Goodput | None:
    """The run's goodput from its history and rank 0's reports; None, said on stderr, when the reports cannot be
    read (the history is shown all the same)."""
    try:
        reports = {a.attempt: store.read_reports(a.attempt) for a in state.attempts}
    except (OSError, CorruptDocument, NewerVersionError) as e:
        print(f"goodput left out: the reports of {state.name} could not be read ({e})", file=sys.stderr)
        return None
    return goodput.split(state, reports, now)


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def render(state: RunState, where: str, held: Goodput | None = None) -> str:
    lines = [f"run {state.name} at {where}", f"status: {state.status}" + (f" ({state.error})" if state.error else "")
             + (f" ({state.waiting_for})" if state.waiting_for else "")]
    if held is not None:
        lines += goodput.describe(held)
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(state.failure_counts.items())) or "none"
    lines.append(f"failures by kind: {counts}")
    lines.append("attempts:")
    for a in state.attempts:
        took = f"{a.ended_at - a.started_at:.1f} s" if a.ended_at else "running or cut short"
        size = f"  {a.workers} workers" if a.workers else ""
        lines.append(f"  #{a.attempt}  {_when(a.started_at)}  {a.outcome or '-':12} {took:>10}  "
                     f"restored from {a.restored_from or 'nothing'}{size}")
        for f in a.failures:
            how = (f"{f.named}: {f.message}" if f.named else
                   f"killed by {signal_name(f.signal)}" if f.signal is not None else f"exit code {f.exit_code}")
            lines.append(f"      rank {f.rank} pid {f.pid} node {f.node_id}: {how}")
    if state.resizes:
        lines.append("resizes (no failure budget drawn):")
    for r in state.resizes:
        lines.append(f"  attempt {r.attempt}  {_when(r.time)}  {r.from_workers} -> {r.to_workers} workers, "
                     f"{r.steps_lost} steps lost: {r.reason}")
    if state.live_recoveries:
        lines.append("live recoveries (each charged to max_failures):")
    for v in state.live_recoveries:
        if v.path == "live":
            how = (f"live: rank(s) {v.ranks} replaced, the state taken from the others in {v.seconds:.2f} s, "
                   f"{v.steps_lost} step(s) lost")
        else:
            how = f"restart from the newest checkpoint: {v.reason}"
        lines.append(f"  attempt {v.attempt}  {_when(v.time)}  {v.cause}; {how}")
    for h in state.hangs:
        lines.append(f"hang in attempt {h.attempt} at {_when(h.time)}: {h.summary}")
        for g in h.stacks:
            ranks = f"rank {g.ranks[0]}" if len(g.ranks) == 1 else f"ranks {g.ranks}"
            lines.append(f"  {ranks} in {g.where}:")
            lines += [f"    {line}" for line in g.text.rstrip().splitlines()]
    lines.append("checkpoints (oldest first):")
    for c in sorted(state.checkpoints, key=lambda c: c.seq):
        mark = "  <- latest" if c.checkpoint_dir == state.latest_checkpoint else ""
        metrics = ", ".join(f"{k}={v}" for k, v in c.metrics.items())
        lines.append(f"  {c.checkpoint_dir}  {_when(c.committed_at)}  {level(c)}  {metrics}{mark}")
    for s in state.skipped_checkpoints:
        lines.append(f"  skipped {s.checkpoint_dir} at {_when(s.time)}: {s.reason}")
    if state.notes:
        lines.append("notes:")
        lines += [f"  {_when(n.time)}  {n.text}" for n in state.notes]
    return "\n".join(lines)


def level(c) -> str:
    """Where a committed checkpoint is held (docs/guide/memory-tier.md): in storage, in which nodes' memory."""
    where = "durable" if c.durable else "not in storage"
    if c.memory:
        where += f", memory: [{', '.join(c.memory)}]" + ("" if c.memory_at is not None else " (one copy)")
    return where
