"""One training job, run unchanged on Ray Train V2 or on outlast.

    python -m bench.lib.core_scenario --framework ray|outlast --mode startup|report|kill \
        --events FILE [--address auto|ADDRESS] [--reports N] [--kill-step K] [--ckpt-every K] [--workers N]

Only the imports differ between the two frameworks (bench/lib/train_api.py). Workers and the driver
append JSON lines to --events; bench/core.py and bench/kill_nodes.py turn them into figures.
"""
import argparse
import os
import shutil
import signal
import tempfile
import time

from bench.lib.events import emit
from bench.lib.train_api import fit, load_api, restored_mlp

STARTUP_STEPS = 5
REPORT_WARMUP_STEPS = 3
STEPS_AFTER_KILL = 10


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

    model, opt, start, restored_from = restored_mlp(api)
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
        config = {"framework": args.framework, "mode": args.mode, "events": events, "reports": args.reports,
                  "kill_step": args.kill_step, "ckpt_every": args.ckpt_every}
        ok = fit(api, train_loop_per_worker, config, events=events, workers=args.workers, name=f"core-{args.mode}",
                 storage=storage)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
