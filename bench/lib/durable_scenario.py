"""Durability scenarios, run unchanged on Ray Train V2 or on outlast.

    python -m bench.lib.durable_scenario --framework ray|outlast --mode kill|overhead \
        --events FILE --storage DIR [--name NAME] [--address auto]

kill:     2 DDP workers, one step every ~50 ms, rank 0 checkpoints every 10
          steps. bench/durable.py SIGKILLs this driver mid-run and launches
          the same command again; the relaunch must resume from the run in
          --storage under --name by itself.
overhead: the same loop timed in four phases: bare (no reports), metrics
          reported every 10 steps, and a ~20 MB checkpoint added to those
          reports, uploaded synchronously, then asynchronously; rank 0
          writes one event per phase.

Only the imports differ between the two frameworks (bench/lib/train_api.py). Workers and the driver
append JSON lines to --events; bench/durable.py turns them into figures.
"""
import argparse
import os
import shutil
import tempfile
import time

from bench.lib.events import emit
from bench.lib.train_api import fit, load_api, restored_mlp

STEP_S = 0.05  # stands in for the accelerator's share of a step: the CPU is free meanwhile
PHASES = ("bare", "metrics", "sync", "async")


def train_loop_per_worker(config):
    # Imports live here so the function does not depend on how the runtime
    # ships it to workers (pickled by value, or re-imported by path).
    import statistics

    import torch
    api = load_api(config["framework"])
    train = api.train
    events, every = config["events"], config["ckpt_every"]
    rank = train.get_context().get_world_rank()
    torch.set_num_threads(1)  # 2 workers on 2 cores, the same budget on both runtimes

    model, opt, start, restored_from = restored_mlp(api)
    # Stands in for the rest of a real model's state: it makes the checkpoint
    # big enough (--ckpt-mb) for its cost to show.
    blob = torch.zeros(config["ckpt_mb"] * 2**20 // 4) if config["mode"] == "overhead" else None

    def step_once(step):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        time.sleep(STEP_S)
        return loss.item()

    def report(step, loss, upload):
        """Every rank reports every `every` steps (unless `upload` is "bare");
        rank 0 adds a checkpoint when `upload` is "sync" or "async".
        Not every step: a Ray Train V2 report waits for the controller's poll
        (every 2 s) once one is already queued.
        """
        if step % every or upload == "bare":
            return None
        metrics = {"step": step, "loss": loss}
        if upload == "metrics" or rank != 0:
            train.report(metrics, checkpoint=None)
            return None
        t0 = time.perf_counter()
        # ASYNC uploads after report() returns, so its directory must outlive
        # this call; both frameworks delete it once uploaded.
        tmp = tempfile.mkdtemp(prefix="ckpt-", dir=config["local_dir"])
        state = {"model": getattr(model, "module", model).state_dict(),
                 "optim": opt.state_dict(), "step": step}
        if blob is not None:
            blob[0] = step
            state["blob"] = blob
        torch.save(state, os.path.join(tmp, "state.pt"))
        t1 = time.perf_counter()
        mode = api.CheckpointUploadMode.ASYNC if upload == "async" else api.CheckpointUploadMode.SYNC
        train.report(metrics, checkpoint=api.Checkpoint.from_directory(tmp),
                     checkpoint_upload_mode=mode)
        t2 = time.perf_counter()
        if upload == "sync":
            shutil.rmtree(tmp, ignore_errors=True)
        return t1 - t0, t2 - t1

    if config["mode"] == "kill":
        for step in range(start, config["steps"] + 1):
            loss = step_once(step)
            report(step, loss, "sync")
            emit(events, ev="step", rank=rank, step=step, t=time.time(),
                 restored_from=restored_from, pid=os.getpid())
        return

    # overhead: phases run back to back in one fit() so that start-up costs
    # stay out of the figures; repeats interleave the phases.
    step = 0
    for rep in range(config["repeat"]):
        for phase in PHASES:
            costs = []
            t0 = time.perf_counter()
            for _ in range(config["steps"]):
                step += 1
                cost = report(step, step_once(step), phase)
                if cost:
                    costs.append(cost)
            elapsed = time.perf_counter() - t0
            if rank == 0:
                emit(events, ev="phase", phase=phase, rep=rep, steps=config["steps"],
                     elapsed_s=elapsed, checkpoints=len(costs),
                     save_s=statistics.median(c[0] for c in costs) if costs else 0.0,
                     save_total_s=sum(c[0] for c in costs),
                     report_s=statistics.median(c[1] for c in costs) if costs else 0.0,
                     t=time.time())
            time.sleep(1.0)  # an async upload still in flight finishes outside the next phase


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=["ray", "outlast"], required=True)
    p.add_argument("--mode", choices=["kill", "overhead"], required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--storage", required=True, help="RunConfig.storage_path")
    p.add_argument("--name", default="durable")
    p.add_argument("--address", default=None, help="'auto' to join a running cluster/agent")
    p.add_argument("--steps", type=int, default=None,
                   help="kill: the run's last step (default 45); overhead: steps per phase (200)")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-mb", type=int, default=20, help="overhead: checkpoint size")
    p.add_argument("--repeat", type=int, default=1, help="overhead: rounds of the four phases")
    p.add_argument("--local-dir", default=None,
                   help="where checkpoints are written before upload (default: the system temp dir)")
    args = p.parse_args()
    events = os.path.abspath(args.events)
    emit(events, ev="driver_start", t=time.time(), pid=os.getpid())

    api = load_api(args.framework)
    if args.framework == "ray":
        # Ray's documented ways: start a local cluster inside this process, or
        # join a running one. Either way it is inside the measured window.
        import ray
        ray.init(address=args.address)
    # outlast needs nothing here: fit() joins a running node or embeds one.

    steps = args.steps or (45 if args.mode == "kill" else 200)
    config = {"framework": args.framework, "mode": args.mode, "events": events, "steps": steps,
              "ckpt_every": args.ckpt_every, "ckpt_mb": args.ckpt_mb, "repeat": args.repeat,
              "local_dir": args.local_dir and os.path.abspath(args.local_dir)}
    ok = fit(api, train_loop_per_worker, config, events=events, workers=2, name=args.name,
             storage=os.path.abspath(args.storage))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
