"""The preemption scenarios' loop, the same on Ray Train V2 and on outlast (`train` is `ray.train` or
`outlast.train`). The workers import this module: standard library only at import."""

from __future__ import annotations

import os
import time

from bench.lib import step_checkpoint
from bench.lib.events import emit


def preemption_loop(train, config: dict, node: str | None, notice_fields, **where) -> None:
    """Logs the attempt's start (with `where`); in the first attempt, times `config["idle_calls"]` calls
    of get_preemption_info() with nothing pending; then each step sleeps ~`config["step_s"]`,
    all-reduces one number (lock step, as DDP), asks for a notice (the first logged with the fields
    `notice_fields(info)` picks), and reports; every `config["ckpt_every"]` steps, and once more on the
    first notice, rank 0's report carries a checkpoint. A restarted attempt trains
    `config["steps_after_restart"]` steps and returns; the first never does."""
    import torch
    import torch.distributed as dist

    events = config["events"]
    rank, pid = train.get_context().get_world_rank(), os.getpid()
    restored_from = step_checkpoint.restored_step(train)
    start = 1 if restored_from is None else restored_from + 1
    emit(events, ev="attempt_start", rank=rank, node=node, pid=pid, restored_from=restored_from, t=time.time(),
         **where)
    if restored_from is None and config["idle_calls"]:
        # The API's cost while nothing is pending (on Ray every call is a broadcast from rank 0
        # through Train's synchronization actor).
        n = config["idle_calls"]
        t0 = time.perf_counter()
        pending = sum(train.get_preemption_info() is not None for _ in range(n))
        emit(events, ev="idle_cost", rank=rank, n=n, per_call_s=(time.perf_counter() - t0) / n, non_none=pending,
             t=time.time())
    last = start + config["steps_after_restart"] - 1 if restored_from is not None else 10**9
    jit_saved = seen = False
    grad = torch.zeros(1)
    for step in range(start, last + 1):
        time.sleep(config["step_s"])
        dist.all_reduce(grad)  # ranks in lock step, as DDP's gradient all-reduce keeps them
        info = train.get_preemption_info()
        if info is not None and not seen:
            seen = True
            emit(events, ev="preempt_seen", rank=rank, step=step, t=time.time(), node=node,
                 deadline_ms=info.deadline_ms, **notice_fields(info))
        jit = info is not None and not jit_saved
        if jit or step % config["ckpt_every"] == 0:
            jit_saved = jit_saved or jit
            step_checkpoint.report(train, {"step": step}, step, save=rank == 0)
            emit(events, ev="ckpt", rank=rank, step=step, jit=jit, t=time.time(), pid=pid)
        else:
            train.report({"step": step})
        emit(events, ev="step", rank=rank, step=step, t=time.time(), node=node, pid=pid, restored_from=restored_from)
