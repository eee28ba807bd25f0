"""The warm floor: the least a runtime that forks from a warm process can do.

    python -m bench.lib.warm_floor --events FILE [--repeat N]

A process imports torch and what DDP imports lazily (untimed, as outlast's fork
server does), then forks two ranks that bring up a gloo group
on loopback and run one DDP step of the core scenario's MLP. From the fork to rank
0's step is the physical limit for a warm start and for a restart: what outlast's
fork server does, without the runtime. Each repeat appends one event
{"ev": "warm_floor", "fork_to_step_s": ...}; the parent exits non-zero if a rank fails.
"""
import argparse
import importlib
import json
import os
import signal
import socket
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, port, t_fork, events):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 * rank + 1)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    if rank == 0:
        with open(events, "a") as f:
            f.write(json.dumps({"ev": "warm_floor", "fork_to_step_s": time.time() - t_fork}) + "\n")
    # No destroy_process_group(): the step's all-reduce is done on both ranks, and the
    # process exits at once (a gloo teardown can wait on its peer's sockets).


def one(events):
    port, t_fork, pids = free_port(), time.time(), []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                rank_main(rank, 2, port, t_fork, events)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    return reap(pids, time.monotonic() + 120)


def reap(pids, deadline):
    """Whether every rank exited 0 before the deadline; a rank still running then is killed."""
    codes = {}
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    for pid in set(pids) - set(codes):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return len(codes) == len(pids) and not any(codes.values())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--events", required=True)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    # The warm part, untimed: what outlast's fork server imports before it forks a worker.
    for name in ("torch", "torch.distributed", "torch.nn.parallel", "torch.utils.data", "torch._dynamo"):
        importlib.import_module(name)
    ok = all([one(os.path.abspath(args.events)) for _ in range(args.repeat)])
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
