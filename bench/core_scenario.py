"""One training job, run unchanged on Ray Train V2 or on outlast.

    python bench/core_scenario.py --framework ray|outlast --mode startup|report|kill \
        --events FILE [--address auto|ADDRESS] [--reports N] [--kill-step K] [--ckpt-every K] [--workers N]

Only the imports differ between the two frameworks. Workers and the driver
append JSON lines to --events; bench_core.py turns them into figures.
"""
import argparse
import json
import os
import shutil
import signal
import tempfile
import time
import types

STARTUP_STEPS = 5
REPORT_WARMUP_STEPS = 3
STEPS_AFTER_KILL = 10


def load_api(framework):
    """The whole framework switch: the same names from either package."""
    if framework == "ray":
        from ray import train
        from ray.train import (Checkpoint, CheckpointConfig, FailureConfig,
                               RunConfig, ScalingConfig)
        from ray.train.torch import TorchTrainer, prepare_model
    elif framework == "outlast":
        from outlast import train
        from outlast.train import (Checkpoint, CheckpointConfig, FailureConfig,
                                   RunConfig, ScalingConfig)
        from outlast.train.torch import TorchTrainer, prepare_model
    else:
        raise ValueError(f"unknown framework {framework!r}")
    return types.SimpleNamespace(
        train=train, Checkpoint=Checkpoint, CheckpointConfig=CheckpointConfig,
        FailureConfig=FailureConfig, RunConfig=RunConfig,
        ScalingConfig=ScalingConfig, TorchTrainer=TorchTrainer,
        prepare_model=prepare_model)


def emit(path, **event):
    # One write per line on an append-mode file, so lines from concurrent
    # processes never interleave.
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()


def batch(rank, step):
    import torch
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def train_loop_per_worker(config):
    # Imports live here so the function does not depend on how the runtime
    # ships it to workers (pickled by value, or re-imported by path).
    import torch
    api = load_api(config["framework"])
    train = api.train
    events, mode = config["events"], config["mode"]
    rank = train.get_context().get_world_rank()
    # Both runtimes get the same thread budget: one thread a rank.
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt_state, start, restored_from = None, 1, None
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        opt_state, restored_from = state["optim"], state["step"]
        start = restored_from + 1

    model = api.prepare_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    loss_fn = torch.nn.CrossEntropyLoss()

    if mode == "startup":
        last = STARTUP_STEPS
    elif mode == "report":
        last = REPORT_WARMUP_STEPS
    else:
        last = config["kill_step"] + STEPS_AFTER_KILL
    every = config["ckpt_every"] if mode == "kill" else 0

    for step in range(start, last + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        metrics = {"step": step, "loss": loss.item()}
        if every and step % every == 0 and rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                base = getattr(model, "module", model)
                torch.save({"model": base.state_dict(), "optim": opt.state_dict(),
                            "step": step}, os.path.join(tmp, "state.pt"))
                train.report(metrics, checkpoint=api.Checkpoint.from_directory(tmp))
        else:
            train.report(metrics, checkpoint=None)
        emit(events, ev="step", rank=rank, step=step, t=time.time(),
             restored_from=restored_from, pid=os.getpid())

        marker = events + ".killed"
        if mode == "kill" and step == config["kill_step"] and rank == 1 \
                and not os.path.exists(marker):
            open(marker, "w").close()
            emit(events, ev="kill", rank=rank, step=step, t=time.time(),
                 pid=os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)

    if mode == "report":
        n = config["reports"]
        t0 = time.perf_counter()
        for i in range(n):
            train.report({"i": i})
        per_call = (time.perf_counter() - t0) / n
        if rank == 0:
            emit(events, ev="report_cost", rank=rank, n=n, per_call_s=per_call,
                 t=time.time())


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=["ray", "outlast"], required=True)
    p.add_argument("--mode", choices=["startup", "report", "kill"], required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--address", default=None,
                   help="'auto' to join a running cluster/agent")
    p.add_argument("--reports", type=int, default=2000)
    p.add_argument("--kill-step", type=int, default=25)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=2, help="ranks (each takes one CPU)")
    args = p.parse_args()
    events = os.path.abspath(args.events)

    api = load_api(args.framework)
    if args.framework == "ray" and args.address:
        import ray
        ray.init(address=args.address)
    # Cold Ray is left to start implicitly inside fit(), the same place where
    # outlast starts its embedded node, so both are inside the measured window.

    storage = tempfile.mkdtemp(prefix=f"core-{args.framework}-")
    try:
        trainer = api.TorchTrainer(
            train_loop_per_worker,
            train_loop_config={
                "framework": args.framework, "mode": args.mode, "events": events,
                "reports": args.reports, "kill_step": args.kill_step,
                "ckpt_every": args.ckpt_every},
            scaling_config=api.ScalingConfig(num_workers=args.workers, use_gpu=False),
            run_config=api.RunConfig(
                name=f"core-{args.mode}", storage_path=storage,
                failure_config=api.FailureConfig(max_failures=3),
                checkpoint_config=api.CheckpointConfig(num_to_keep=2)),
        )
        emit(events, ev="fit_start", t=time.time())
        ok = False
        try:
            result = trainer.fit()
            ok = result.error is None
        finally:
            emit(events, ev="fit_end", t=time.time(), ok=ok)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
