"""An Executor task as its executor keeps it, where its worker imports from, and how its output
lines are printed on the executor's side."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import Any

from outlast.protocol import messages as m


@dataclass
class Task:
    id: str
    payload: bytes
    future: cf.Future[Any]
    not_before: float = 0.0
    oom_kills: int = 0
    failures: int = 0
    reports: list[m.KillReport] = field(default_factory=list)
    running: bool = False
    exited_ok_at: float | None = None
    retry_pending: bool = False  # retry once its process has exited
    output_seq: int = 0  # the next line of its current process's output


def format_task_output(ev: m.WorkerOutput, expected_seq: int) -> str:
    """The lines as the executor prints them, `[task ID NODE] line`; `expected_seq` is the number
    of the task's next line: a gap before `ev.seq` is lines its node skipped, said in a line."""
    prefix = f"[task {ev.task_id} {ev.node_id}]"
    gap = ev.seq - expected_seq
    text = f"{prefix} ({gap} lines not shown: the task wrote faster than they were read)\n" if gap > 0 else ""
    return text + "".join(f"{prefix} {line}\n" for line in ev.lines)
