"""The loop of bench/live_recovery_kills.py: a small MLP, ~20 ms steps, under outlast's Trainer.fit(), that
kills its own rank at the instants its kill plan names (bench/lib/live_kills.py).

Each step runs the phases of bench/lib/live_kills.PHASES: forward, backward (each with its share of the
sleep that makes a ~20 ms step), the allreduce of the gradients as one flat tensor, the optimizer's step,
and a report: of metrics alone, or on rank 0 every `ckpt_every` steps with a checkpoint (its save and
upload). With live recovery on, the allreduce and the vote are `LiveTraining.step`; off, the same flat
allreduce over torch.distributed's default group, the step restored from the newest checkpoint after a
restart.

A kill: when the process holding the victim's rank enters the kill's phase of its step, a thread sleeps the
kill's fraction of that phase's usual length here (the median of its last lengths), appends a "kill" event
naming the phase the loop is in at that instant, and SIGKILLs the process. A marker file per kill makes it
happen once: the replacement, or a restarted group, runs the step again without it.

Events (one line each, bench/lib/events.py): "start", "step" (applied) or "thrown" (live recovery threw
it away), "kill". With `final_dir`, each rank saves its final model state dict there. The workers import
this module: standard library only at import time.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import threading
import time

from bench.lib.events import emit


def _batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)  # a step run again reads the batch it read first
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


class Phases:
    """The phase the loop is in, each phase's recent lengths, and the kills of this rank still to make."""

    def __init__(self, config: dict, rank: int, attempt: int, start: int) -> None:
        self.events, self.marks = config["events"], config["marks"]
        self.rank, self.attempt = rank, attempt
        self.phase, self.step, self.entered = "start", start, time.perf_counter()
        self.lengths: dict[str, list[float]] = {}
        self.kills = {k["step"]: k for k in config.get("kills", ()) if k["rank"] == rank and k["step"] >= start}

    def enter(self, phase: str, step: int) -> None:
        now = time.perf_counter()
        self.lengths.setdefault(self.phase, []).append(now - self.entered)
        del self.lengths[self.phase][:-20]
        self.phase, self.step, self.entered = phase, step, now
        kill = self.kills.get(step)
        if kill is not None and kill["phase"] == phase:
            del self.kills[step]
            if not os.path.exists(self._mark(kill)):
                usual = statistics.median(self.lengths.get(phase) or [0.001])
                threading.Thread(target=self._fire, args=(kill, kill["fraction"] * usual), daemon=True).start()

    def _mark(self, kill: dict) -> str:
        return os.path.join(self.marks, f"kill-{kill['index']}")

    def _fire(self, kill: dict, delay: float) -> None:
        time.sleep(delay)
        try:
            os.close(os.open(self._mark(kill), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        emit(self.events, ev="kill", **kill, hit_phase=self.phase, hit_step=self.step, attempt=self.attempt,
             pid=os.getpid(), delay_s=round(delay, 5), load1=round(os.getloadavg()[0], 2), t=time.time())
        os.kill(os.getpid(), signal.SIGKILL)


def loop(config: dict) -> None:
    import torch
    import torch.distributed as dist

    from outlast import train

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    sys.setswitchinterval(0.0002)  # a kill thread waking in a phase that holds the GIL gets it soon
    ctx = train.get_context()
    rank, world, attempt = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_attempt()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step, live = 0, None
    if config["live"]:
        from outlast.train.torch import LiveTraining

        live = LiveTraining(model, opt)
        step = live.start()
    else:
        ckpt = train.get_checkpoint()
        if ckpt is not None:
            with ckpt.as_directory() as d:
                state = torch.load(os.path.join(d, "state.pt"))
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            step = state["step"] + 1
    phases = Phases(config, rank, attempt, step)
    opt.register_step_pre_hook(lambda *_: phases.enter("optimizer", phases.step))
    opt.register_step_post_hook(lambda *_: phases.enter("after_optimizer", phases.step))
    emit(config["events"], ev="start", rank=rank, attempt=attempt, pid=os.getpid(), step=step,
         netns=os.stat("/proc/self/ns/net").st_ino, t=time.time())  # the node: each has a network namespace
    pad, every = config["pad_s"], config["ckpt_every"]
    while step < config["steps"]:
        x, y = _batch(step, rank)
        phases.enter("forward", step)
        time.sleep(pad / 3)  # the rest of a ~20 ms step: a third in forward, two in backward
        loss = torch.nn.functional.cross_entropy(model(x), y)
        phases.enter("backward", step)
        loss.backward()
        time.sleep(pad * 2 / 3)
        done = step
        phases.enter("allreduce", step)
        if live is not None:
            step = live.step(step)
        else:
            params = list(model.parameters())
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
            opt.step()
            opt.zero_grad()
            step += 1
        applied = step == done + 1
        emit(config["events"], ev="step" if applied else "thrown", rank=rank, attempt=attempt, pid=os.getpid(),
             step=done, t=time.time())
        if not applied:
            continue
        if every and rank == 0 and (done + 1) % every == 0:
            phases.enter("checkpoint", done)
            with tempfile.TemporaryDirectory() as tmp:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": done},
                           os.path.join(tmp, "state.pt"))
                train.report({"step": done}, checkpoint=train.Checkpoint.from_directory(tmp))
        else:
            phases.enter("report", done)
            train.report({"step": done})
        phases.enter("between", step)
    if config.get("final_dir"):
        torch.save(model.state_dict(), os.path.join(config["final_dir"], f"rank{rank}.pt"))
    if live is not None:
        live.close()
