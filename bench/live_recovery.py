"""Live recovery: from a rank's SIGKILL to training again, survivors kept, beside the warm floor.

    python -m bench.live_recovery [--repeat 5] [--state-mb 100] [--world 2]

Each repeat forms a live group (outlast/train/live) of `--world` ranks plus a warm spare, all
forked from one fork server that imported torch, with the store in this process (where
outlast's controller would hold it). The ranks train the core scenario's MLP; at a random
instant after step 10 a rank (rank 0 and the others in turn) is SIGKILLed, and this process
publishes the next generation with the spare in its place at once (a controller learns of the
death from the process's exit within milliseconds). The state each survivor keeps, and the
spare receives, is the model and optimizer plus `--state-mb` MB of padding, so the transfer is
that of a model of that size.

Figures per repeat (seconds from the SIGKILL, on the machine's monotonic clock):
  kill_to_raise_s        a survivor's pending collective raised (or its vote was voided)
  transfer_s             the spare received the state from the source and checked it (of the next)
  kill_to_formed_and_transferred_s  the survivors formed the next generation with the spare and sent it the state
  kill_to_training_s     the first step committed by the new generation: training again
The warm floor (bench/lib/warm_floor.py) runs in the same invocation: a warm fork to one DDP step.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

STEPS = 40
KILL_AFTER = 10


def rank_main(port: int, member: str, events: str, state_mb: int) -> None:
    import torch

    from outlast.train.live import rendezvous
    from outlast.train.live.live_rank import LiveRank

    torch.set_num_threads(1)
    store = rendezvous.connect("127.0.0.1", port, timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    padding = torch.zeros(state_mb * 2**20 // 4)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "opt": opt.state_dict(), "padding": padding}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        padding.copy_(state["padding"])

    def emit(**e) -> None:
        with open(events, "a") as f:
            f.write(json.dumps({"member": member, "t": time.monotonic(), **e}) + "\n")

    live = LiveRank(store, member, timeout_s=60)
    def join() -> int:
        step = live.join(state_dict, load_state_dict)
        j = live.joins[-1]
        emit(ev="joined", generation=j.generation, rank=j.rank, state_bytes=j.state_bytes, transfer_s=j.transfer_s)
        return step

    step = join()
    while step < STEPS:
        opt.zero_grad()
        g = torch.Generator().manual_seed(1000 * live.rank + step)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([gr.reshape(-1) for gr in grads])
        world = live.group.world_size
        if live.reduce(step, [flat]):
            offset = 0
            for gr in grads:
                gr.copy_(flat[offset:offset + gr.numel()].view_as(gr) / world)
                offset += gr.numel()
            opt.step()
            emit(ev="step", step=step, generation=live.group.generation, rank=live.rank)
            step += 1
            time.sleep(0.01)  # a step of about 10 ms, so the kill lands at a random phase of one
        else:
            emit(ev="broken", step=step)
            step = join()
    live.close()


def one(forks, state_mb: int, world: int, victim: int, workdir: str, i: int) -> dict:
    import torch.distributed as dist

    from outlast.train.live import rendezvous
    from outlast.protocol.membership import first_membership, replace_members

    events = os.path.join(workdir, f"live-{i}.jsonl")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    members = [f"r{i}w{r}" for r in range(world)]
    procs = {m: forks.Process(target=rank_main, args=(store.port, m, events, state_mb)) for m in members + ["spare"]}
    for p in procs.values():
        p.start()
    first = first_membership(members)
    rendezvous.publish(store, first)
    while not _steps(events, KILL_AFTER):
        time.sleep(0.005)
    time.sleep(random.uniform(0, 0.03))
    t_kill = time.monotonic()
    procs[members[victim]].kill()
    rendezvous.publish(store, replace_members(first, {members[victim]: "spare"}))
    procs[members[victim]].join()
    for p in procs.values():
        p.join(timeout=120)
    ev = [json.loads(line) for line in open(events)]
    survivors = [m for m in members if m != members[victim]]
    broken = [e["t"] for e in ev if e["ev"] == "broken" and e["member"] in survivors]
    joined = [e for e in ev if e["ev"] == "joined" and e["member"] == "spare" and e["generation"] == 1]
    new_steps = [e["t"] for e in ev if e["ev"] == "step" and e.get("generation") == 1]
    src_joined = [e["t"] for e in ev if e["ev"] == "joined" and e["member"] in survivors and e["generation"] == 1]
    exits = {m: p.exitcode for m, p in procs.items() if m != members[victim]}
    return {"victim_rank": victim,
            "kill_to_raise_s": min(broken) - t_kill if broken else None,
            "kill_to_formed_and_transferred_s": max(src_joined) - t_kill if src_joined else None,
            "kill_to_training_s": min(new_steps) - t_kill if new_steps else None,
            "transfer_s": joined[0]["transfer_s"] if joined else None,
            "state_bytes": joined[0]["state_bytes"] if joined else None,
            "steps_lost": _steps_lost(ev, survivors),
            "exit_codes_ok": all(c == 0 for c in exits.values())}


def _steps(events: str, n: int) -> bool:
    try:
        return sum(1 for line in open(events) if '"step"' in line) >= n
    except FileNotFoundError:
        return False


def _steps_lost(ev: list[dict], survivors: list[str]) -> int:
    """Steps a survivor ran twice: each aborted step is run again once, so 0 or 1."""
    member = survivors[0]
    return sum(1 for e in ev if e["ev"] == "broken" and e["member"] == member)




def warm_floor(repeat: int, workdir: str) -> list[float]:
    events = os.path.join(workdir, "warm-floor.jsonl")
    subprocess.run([sys.executable, "-m", "bench.lib.warm_floor", "--events", events, "--repeat", str(repeat)],
                   check=True, timeout=600)
    return [json.loads(line)["fork_to_step_s"] for line in open(events)]


def summary(xs: list) -> dict | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return {"n": len(xs), "min": round(xs[0], 4), "median": round(xs[len(xs) // 2], 4), "max": round(xs[-1], 4)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--state-mb", type=int, default=100)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    forks = mp.get_context("forkserver")
    forks.set_forkserver_preload(["torch", "torch.distributed", "outlast.train.live.live_rank"])
    load = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="live-recovery-") as workdir:
        runs = [one(forks, args.state_mb, args.world, i % args.world, workdir, i) for i in range(args.repeat)]
        floor = warm_floor(args.repeat, workdir)
    keys = ("kill_to_raise_s", "transfer_s", "kill_to_formed_and_transferred_s", "kill_to_training_s")
    live = {k: summary([r[k] for r in runs]) for k in keys}
    out = {"bench": "live_recovery", "world": args.world, "state_mb": args.state_mb, "repeat": args.repeat,
           "load1_at_start": load[0], "live": live, "warm_floor_fork_to_step_s": summary(floor),
           "live_over_warm_floor": (round(live["kill_to_training_s"]["median"] / summary(floor)["median"], 2)
                                    if live["kill_to_training_s"] and floor else None),
           "runs": runs}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
