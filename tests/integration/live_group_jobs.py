"""A member of a live group, as its own process: a small deterministic model trained a few steps.

    python -m tests.integration.live_group_jobs PORT MEMBER OUT STEPS [PAUSE_STEP PHASE]

It writes its final weights, pid, joins and the breaks it saw to OUT/MEMBER.pt. With PAUSE_STEP,
at that step it writes `paused/MEMBER` in the store and stops at PHASE: "allreduce" (its peers
are inside theirs), "vote" (its allreduce returned, its vote not cast), "apply" (the step was
committed, the optimizer step not applied), for the test to SIGKILL it there.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from outlast.train.live import rendezvous
from outlast.train.live.live_rank import LiveRank

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def main(port: int, member: str, out: str, steps: int, pause_step: int | None, phase: str | None) -> None:
    store = rendezvous.connect("127.0.0.1", port, timeout_s=30)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])

    live = LiveRank(store, member, timeout_s=30)
    breaks = []
    step = live.join(state_dict, load_state_dict)
    while step < steps:
        opt.zero_grad()
        x, y = batch(live.rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        world = live.group.world_size
        if step == pause_step and phase == "allreduce":
            pause(store, member)
        if step == pause_step and phase == "vote":
            live.group.allreduce_sum([flat])
            pause(store, member)
        if live.reduce(step, [flat]):
            if step == pause_step and phase == "apply":
                pause(store, member)
            offset = 0
            for g in grads:  # the mean gradient back into each parameter's .grad
                g.copy_(flat[offset:offset + g.numel()].view_as(g) / world)
                offset += g.numel()
            opt.step()
            step += 1
        else:
            breaks.append({"step": step, "error": live.last_break})
            step = live.join(state_dict, load_state_dict)
    torch.save({"model": model.state_dict(), "pid": os.getpid(), "breaks": breaks,
                "joins": [j.__dict__ for j in live.joins]}, os.path.join(out, f"{member}.pt"))
    live.close()


def pause(store, member: str) -> None:
    store.set(f"paused/{member}", str(os.getpid()))
    while True:
        time.sleep(1)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), a[1], a[2], int(a[3]), int(a[4]) if len(a) > 4 else None, a[5] if len(a) > 5 else None)


def held_break(port: int, rank: int, out: str) -> None:
    """One of four members of a group whose rank 1 exits: ranks 0 and 2, whose allgather fails on the lost rank,
    stay in their handler of the failure until rank 3 says its own allgather ended, or 90 s (past the group's
    timeout), as a loop that joins the next group from inside its handler does. Each writes what its allgather
    raised to OUT/RANK.txt."""
    from outlast.train.live.group import GroupBroken, LiveGroup

    store = rendezvous.connect("127.0.0.1", port, timeout_s=30)
    group = LiveGroup.form(store, 0, rank, 4, timeout_s=60)
    group.allgather(torch.ones(4))
    if rank == 1:
        os._exit(0)
    try:
        group.allgather(torch.ones(64))
        said = "ok"
    except GroupBroken as e:
        said = str(e)
        if rank != 3:
            deadline = time.monotonic() + 90
            while not store.check(["released/3"]) and time.monotonic() < deadline:
                time.sleep(0.01)
    if rank == 3:
        store.set("released/3", "1")
    with open(os.path.join(out, f"{rank}.txt"), "w") as f:
        f.write(said)
