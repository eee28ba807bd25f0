"""Fault-tolerant DDP training on the embedded local node.

Two CPU workers train a small classifier on a synthetic two-spiral data set with
DistributedDataParallel (gloo). Rank 0 saves a checkpoint every `--checkpoint-every`
steps. At `--kill-step`, rank `--kill-rank` is killed with SIGKILL (first attempt
only): outlast restarts both workers from the latest committed checkpoint and the
run finishes. The script then prints the run's history from storage, and its goodput: of the
time the run held its workers, the share that went into steps that stayed, and where the rest went.

    python examples/ddp_demo.py --kill-rank 1 --kill-step 120
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import tempfile
import time

import torch

from outlast import train
from outlast.storage import open_storage
from outlast.storage.goodput import describe, split
from outlast.storage.run_store import RunStore
from outlast.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from outlast.train.torch import TorchTrainer, prepare_model


def spirals(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 3 * math.pi
    label = torch.randint(0, 2, (n,), generator=g)
    r = t / (3 * math.pi)
    angle = t + label * math.pi
    x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1)
    return x + 0.02 * torch.randn(n, 2, generator=g), label


def train_loop(config: dict) -> None:
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(
        torch.nn.Linear(2, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=config["lr"])
    x_all, y_all = spirals(4096, seed=7)
    x, y = x_all[rank::world], y_all[rank::world]  # each rank trains on its own shard
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
        if rank == 0:
            print(f"[attempt {ctx.get_attempt()}] restored the checkpoint of step {state['step']}", flush=True)
    for step in range(start, config["steps"]):
        batch = torch.randint(0, len(x), (128,), generator=torch.Generator().manual_seed(step * world + rank))
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        saved = None
        if (step + 1) % config["checkpoint_every"] == 0 and rank == 0:
            d = tempfile.mkdtemp()
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                       os.path.join(d, "state.pt"))
            saved = Checkpoint.from_directory(d)
        metrics = {"step": step, "loss": loss.item()}
        if (step + 1) % config["log_every"] == 0:
            with torch.no_grad():
                metrics["accuracy"] = (model(x).argmax(1) == y).float().mean().item()
            if rank == 0:
                print(f"[attempt {ctx.get_attempt()}] step {step + 1:4d}  loss {loss.item():.3f}  "
                      f"accuracy {metrics['accuracy']:.3f}{'  (checkpoint)' if saved else ''}", flush=True)
        train.report(metrics, checkpoint=saved)
        if step == config["kill_step"] and rank == config["kill_rank"] and ctx.get_attempt() == 1:
            print(f"[attempt 1] killing rank {rank} (pid {os.getpid()}) with SIGKILL at step {step + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--kill-rank", type=int, default=1, help="rank to kill (-1: none)")
    p.add_argument("--kill-step", type=int, default=120, help="step at which to kill it")
    p.add_argument("--max-failures", type=int, default=3)
    p.add_argument("--storage-path", default=None, help="default: a new temporary directory")
    p.add_argument("--name", default="ddp_demo")
    args = p.parse_args()

    storage = args.storage_path or tempfile.mkdtemp(prefix="outlast_demo_")
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"steps": args.steps, "checkpoint_every": args.checkpoint_every, "lr": args.lr,
                           "log_every": args.log_every, "kill_rank": args.kill_rank, "kill_step": args.kill_step - 1},
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(name=args.name, storage_path=storage,
                             failure_config=FailureConfig(max_failures=args.max_failures)),
    )
    started = time.time()
    result = trainer.fit()
    took = time.time() - started

    with open(os.path.join(result.path, "run_state.json")) as f:
        history = json.load(f)
    print(f"\nfinished in {took:.1f} s: step {result.metrics['step'] + 1}, "
          f"final accuracy {result.metrics.get('accuracy', float('nan')):.3f}")
    print(f"latest checkpoint: {result.checkpoint.path}")
    for attempt in history["attempts"]:
        restored = attempt["restored_from"] or "nothing (fresh start)"
        print(f"attempt {attempt['attempt']}: {attempt['outcome']}, restored from {restored}")
        for failure in attempt["failures"]:
            how = f"signal {failure['signal']}" if failure["signal"] else f"exit code {failure['exit_code']}"
            print(f"  rank {failure['rank']} (pid {failure['pid']}) died: {how}")
    # Of the time the run held its workers, what went into steps that stayed, and where the rest went
    # (docs/guide/watching.md; `outlast runs STORAGE_PATH NAME` shows the same).
    store = RunStore(open_storage(storage), args.name)
    state = store.load_state()
    print("\n".join(describe(split(state, {a.attempt: store.read_reports(a.attempt) for a in state.attempts},
                                   time.time()))))


if __name__ == "__main__":
    main()
