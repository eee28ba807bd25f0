"""What a rank's first full collection costs, forked from a fork server with its objects frozen or not.

    python -m bench.lib.fork_collect frozen|unfrozen

Imports what an embedded node's fork server imports (outlast/agent/zygote.py's `preload`, which freezes
what it imported; `unfrozen` undoes that), forks one child that runs five DDP steps of the core
scenario's MLP on a one-rank gloo group, then `gc.collect()`. Prints one JSON line: the child's own
memory (USS, /proc/self/smaps_rollup) after the steps and after the collection, and the collection's time.
"""
import gc
import json
import os
import socket
import sys
import time


def uss_mib():
    own = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                own += int(line.split()[1])
    return own / 1024


def child():
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,))).backward()
        opt.step()
    after_steps = uss_mib()
    t0 = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t0
    print(json.dumps({"frozen_objects": gc.get_freeze_count(), "uss_after_steps_mib": after_steps,
                      "uss_after_full_collection_mib": uss_mib(), "full_collection_s": took}), flush=True)


def main():
    from outlast.agent import zygote
    from outlast.client.preload import default_preload

    zygote.preload(default_preload())
    if sys.argv[1] == "unfrozen":
        gc.unfreeze()
    pid = os.fork()
    if pid == 0:
        try:
            child()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
