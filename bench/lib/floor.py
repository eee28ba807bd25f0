"""The floor: the least any runtime can do for the core scenario's first step.

    python -m bench.lib.floor --events FILE

Imports torch, brings up a 2-process gloo group on loopback, runs one DDP
step of the same MLP, and has rank 0 append a step event. bench/core.py
measures from its Popen of this script to that event.
"""
import argparse
import json
import os
import socket
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, events):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 * rank + 1)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    if rank == 0:
        with open(events, "a") as f:
            f.write(json.dumps({"ev": "step", "rank": 0, "step": 1, "t": time.time(),
                                "loss": loss.item()}) + "\n")
            f.flush()
    # Out at once, without destroy_process_group(): the step's all-reduce is done on both
    # ranks, and a gloo teardown racing its peer's exit sometimes aborts the process.
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--events", required=True)
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(2, os.path.abspath(args.events)), nprocs=2, join=True)


if __name__ == "__main__":
    main()
