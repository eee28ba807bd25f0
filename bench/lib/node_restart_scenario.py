"""One training run on an embedded node in which rank 1 kills, once, at step --kill-step:
itself ("worker"), its fork server ("forkserver") or its node agent ("agent").

    python bench/lib/node_restart_scenario.py --kill worker|forkserver|agent --events FILE --storage DIR

Workers append JSON lines to --events; bench/node_restarts.py and bench/restart_breakdown.py turn them
into figures through `run`. Run as a file, with the outlast of PYTHONPATH: it imports nothing of bench,
so that `restart_breakdown.py --before DIR` runs this same scenario on an earlier checkout's outlast.
"""
import argparse
import json
import os
import signal
import subprocess
import tempfile
import time


def emit(path, **event):
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def standbys_ready(kind):
    """Whether the node's standbys are ready, read from outlast's trace (OUTLAST_TRACE_FILE): the kill
    comes once they are, as on any node that has run longer than an `import torch`, and not while
    they import (which takes the CPU from the restart)."""
    path = os.environ.get("OUTLAST_TRACE_FILE")
    if not path or not os.path.exists(path):
        return True
    phases = [json.loads(line)["phase"] for line in open(path) if line.strip()]
    if kind == "forkserver":
        return "agent.standby_ready" in phases
    # The standby agent waits, and three fork servers have imported: the agent's, its standby, the standby agent's.
    return "agent.standby_waiting" in phases and phases.count("zygote.ready") >= 3


def loop(config):
    import psutil
    import torch

    from outlast import train
    from outlast.train import Checkpoint
    from outlast.train.torch import prepare_model

    torch.set_num_threads(1)
    ctx = train.get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    start = 0
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        start = state["step"] + 1
    model = prepare_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # After the restart, 15 steps more; before it, until the kill (once the standbys are ready).
    for step in range(start, start + 15 if attempt > 1 else config["steps"]):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(config["step_s"])
        checkpoint = None
        if rank == 0 and (step + 1) % config["every"] == 0:
            d = tempfile.mkdtemp()
            torch.save({"model": model.module.state_dict(), "step": step}, os.path.join(d, "state.pt"))
            checkpoint = Checkpoint.from_directory(d)
        train.report({"step": step}, checkpoint=checkpoint)
        emit(config["events"], ev="step", rank=rank, attempt=attempt, step=step, t=time.time())
        if attempt == 1 and rank == 1 and step >= config["kill_step"] and (
                standbys_ready(config["kill"]) or step >= config["steps"] - 5):
            kind = config["kill"]
            pid = {"worker": os.getpid(), "forkserver": os.getppid()}.get(kind) or psutil.Process(os.getppid()).ppid()
            emit(config["events"], ev="kill", kind=kind, pid=pid, t=time.time())
            os.kill(pid, signal.SIGKILL)
            time.sleep(60)  # dies with its fork server


def run(kind, python, work, env, timeout_s):
    """Runs this file with `python` and `env` in the directory `work` (its events and storage there):
    (the kill's time, when every rank had finished its first step after it). RuntimeError with the
    run's stderr when it failed."""
    events = os.path.join(work, "events.jsonl")
    done = subprocess.run([python, os.path.abspath(__file__), "--kill", kind, "--events", events,
                           "--storage", os.path.join(work, "storage")],
                          env=env, cwd=work, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} run failed:\n{done.stderr[-3000:]}")
    with open(events) as f:
        evs = [json.loads(line) for line in f if line.strip()]
    firsts = {}
    for e in evs:
        if e["ev"] == "step" and e["attempt"] == 2:
            firsts.setdefault(e["rank"], e["t"])
    return next(e["t"] for e in evs if e["ev"] == "kill"), max(firsts.values())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kill", choices=["worker", "forkserver", "agent"], required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--kill-step", type=int, default=12)
    p.add_argument("--step-s", type=float, default=0.05)
    a = p.parse_args()
    from outlast.train import FailureConfig, RunConfig, ScalingConfig
    from outlast.train.torch import TorchTrainer

    TorchTrainer(loop, train_loop_config={"events": a.events, "steps": a.steps, "kill_step": a.kill_step,
                                          "kill": a.kill, "every": 5, "step_s": a.step_s},
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name="run", storage_path=a.storage,
                                      failure_config=FailureConfig(max_failures=1))).fit()


if __name__ == "__main__":
    main()
