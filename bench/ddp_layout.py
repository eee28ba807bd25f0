"""Why a restored DDP run differs in its last bits at 3 ranks, and what keeping one bucket layout costs.

    python3 -m bench.ddp_layout [--world 3] [--steps 200] [--out FILE.json]

Plain torch.distributed, no outlast: `--world` gloo processes on the CPU, one thread each.

- `layouts`: for 2, 3 and 4 ranks, whether the first iteration of a new DistributedDataParallel gives
  the same averaged gradients, bit for bit, as a later iteration with the same weights and data. The
  first runs in the constructor's bucket layout (every parameter in one bucket, in definition order);
  buckets are rebuilt before the second, in the order gradients became ready. Gloo's ring allreduce
  sums each element starting at a rank that depends on the element's place in its bucket, so the two
  layouts sum in different orders once a + b + c is no longer commutative: at 3 ranks and more.
  With `find_unused_parameters=True` buckets are never rebuilt (reducer.hpp,
  `should_rebuild_buckets`), and the first iteration matches every later one.
- `fixed layout`: what `prepare_model` does (outlast.train.torch.ddp_layout): one backward of zeros before the
  first real one, so that the buckets are rebuilt before it, in an order that depends on the model alone.
- `cost`: the time of a training step (forward, backward with its allreduce, SGD) under each setting,
  for three models, all settings trained in the same processes and alternated step by step so that
  the machine's load falls on both alike.
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

from bench.lib.harness import load, machine, publish

# name: (DDP's keyword arguments, whether prepare_model's fix_bucket_layout runs on it)
SETTINGS = {"rebuilt (torch's default)": ({}, False),
            "fixed layout (prepare_model)": ({}, True),
            "never rebuilt (find_unused_parameters=True)": ({"find_unused_parameters": True}, False)}
BASE = "rebuilt (torch's default)"


def _ddp(model, kwargs: dict, fix_layout: bool):
    from torch.nn.parallel import DistributedDataParallel

    from outlast.train.torch.ddp_layout import fix_bucket_layout

    ddp = DistributedDataParallel(model, **kwargs)
    if fix_layout:
        fix_bucket_layout(ddp)
    return ddp


def _model(kind: str):
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    if kind == "chaos job's MLP (8-32-1)":
        return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)), (16, 8)
    if kind == "MLP, 4.2M parameters (4 x 1024)":
        layers = []
        for _ in range(4):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(1024, 1)), (32, 1024)
    # Many small parameter tensors: what an autograd graph traversal per iteration costs most on.
    layers = [nn.Conv2d(3, 32, 3, padding=1)]
    for _ in range(24):
        layers += [nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1)), (4, 3, 8, 8)


MODELS = ["chaos job's MLP (8-32-1)", "MLP, 4.2M parameters (4 x 1024)", "conv net, 25 conv + 24 batch norm (99 tensors)"]


def _grads(ddp, state, x, target):

    ddp.module.load_state_dict(state)
    for p in ddp.parameters():
        p.grad = None
    ((ddp(x) - target) ** 2).mean().backward()
    return [p.grad.clone() for p in ddp.parameters()]


def _layouts(rank: int, world: int) -> dict:
    import torch

    found = {}
    for name, (kwargs, fix_layout) in SETTINGS.items():
        model, shape = _model(MODELS[0])
        state = {k: v.clone() for k, v in model.state_dict().items()}
        ddp = _ddp(model, kwargs, fix_layout)
        g = torch.Generator().manual_seed(7000 + rank)
        x = torch.randn(*shape, generator=g)
        target = torch.sin(x.sum(dim=1, keepdim=True))
        first = _grads(ddp, state, x, target)
        _grads(ddp, state, torch.randn(*shape, generator=g), target)
        later = _grads(ddp, state, x, target)
        found[name] = {"first_iteration_equals_later": all(torch.equal(a, b) for a, b in zip(first, later)),
                       "max_abs_difference": max((a - b).abs().max().item() for a, b in zip(first, later)),
                       "buckets_rebuilt": bool(ddp._has_rebuilt_buckets)}
    return found


def _cost(rank: int, steps: int) -> dict:
    import torch

    found = {}
    for kind in MODELS:
        pairs = {}
        for name, (kwargs, fix_layout) in SETTINGS.items():
            model, shape = _model(kind)
            ddp = _ddp(model, kwargs, fix_layout)
            pairs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4), shape)
        times = {name: [] for name in SETTINGS}
        g = torch.Generator().manual_seed(rank)
        for step in range(steps):
            for name, (ddp, opt, shape) in pairs.items():
                x = torch.randn(*shape, generator=g)
                started = time.perf_counter()
                loss = ddp(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if step >= 5:
                    times[name].append(time.perf_counter() - started)
        found[kind] = {name: {"median_ms": round(statistics.median(t) * 1e3, 3),
                              "p10_ms": round(sorted(t)[len(t) // 10] * 1e3, 3),
                              "p90_ms": round(sorted(t)[len(t) * 9 // 10] * 1e3, 3), "n": len(t)}
                       for name, t in times.items()}
        base = found[kind][BASE]["median_ms"]
        found[kind]["ratio_to_default"] = {name: round(found[kind][name]["median_ms"] / base, 3)
                                           for name in SETTINGS if name != BASE}
    return found


def _worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    found = {"layouts": _layouts(rank, world)}
    if steps:
        found["cost"] = _cost(rank, steps)
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, steps: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.json")
        mp.spawn(_worker, args=(world, _free_port(), steps, out), nprocs=world)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=3, help="ranks for the cost figures")
    p.add_argument("--steps", type=int, default=200, help="steps per model and setting")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch

    started = time.time()
    load_before = load()
    runs = {w: _spawn(w, args.steps if w == args.world else 0) for w in sorted({2, 3, 4, args.world})}
    result = {"bench": "ddp_layout", "machine": machine({"torch": torch.__version__}),
              "load_before": load_before, "load_after": load(), "seconds": round(time.time() - started, 1),
              "world_for_cost": args.world, "steps": args.steps,
              "layouts": {str(w): run["layouts"] for w, run in runs.items()}, "cost": runs[args.world]["cost"]}
    publish(result, args.out)


if __name__ == "__main__":
    main()
