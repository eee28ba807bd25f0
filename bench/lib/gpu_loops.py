"""The training loops of scripts/gpu-check (bench/gpu_check.py runs them): each writes what it saw
as JSON lines to `config["events"]`, which the check reads back and judges. They run in workers,
forked by a node's fork server, on CUDA with NCCL (`use_gpu=True`)."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time

from bench.lib import events


def emit(config: dict, **event) -> None:
    event.setdefault("t", time.time())
    event.setdefault("rank", int(os.environ.get("RANK", "-1")))
    event.setdefault("attempt", int(os.environ.get("OUTLAST_ATTEMPT", "0")))
    events.emit(config["events"], **event)


def digest(tensors: dict) -> str:
    """xxh3-128 of every tensor's bytes, in key order: equal digests are bit-exact equal states."""
    import torch
    import xxhash

    h = xxhash.xxh3_128()
    for key in sorted(tensors):
        t = tensors[key]
        if hasattr(t, "full_tensor"):  # a DTensor (FSDP2): the whole parameter
            t = t.full_tensor()
        h.update(key.encode())
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _die_mid_step(dev) -> None:
    """SIGKILL this rank with a kernel still running on its GPU."""
    import torch

    a = torch.randn(8192, 8192, device=dev)
    for _ in range(8):
        a = a @ a
    os.kill(os.getpid(), signal.SIGKILL)


def ddp_loop(config: dict) -> None:
    """NCCL DDP: the device, the backend, what the fork left of CUDA, a loss that falls."""
    import torch
    import torch.distributed as dist

    bad_fork = torch.cuda._is_in_bad_fork()  # set by torch's fork handler if the fork server had CUDA
    from torch.nn.parallel import DistributedDataParallel

    from outlast import train
    from outlast.train.torch import get_device

    dev = get_device()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).to(dev),
        device_ids=[dev] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(512, 256, device=dev)
    y = x[:, :1].clone()
    losses = []
    for step in range(40):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        train.report({"step": step, "loss": losses[-1]})
    total = torch.ones(1, device=dev)
    dist.all_reduce(total)
    emit(config, ev="done", device=str(dev), backend=dist.get_backend(), bad_fork=bad_fork,
         param_device=str(next(model.parameters()).device), first_loss=losses[0], last_loss=losses[-1],
         all_reduce=total.item(), world_size=dist.get_world_size(),
         visible=os.environ.get("CUDA_VISIBLE_DEVICES"), own=os.environ.get("OUTLAST_CUDA_DEVICES"))


def kill_loop(config: dict) -> None:
    """Holds `hog_gb` of GPU memory, checkpoints every 5 steps, dies by SIGKILL mid-step at step 12 of
    attempt 1 (rank `kill_rank`); the next attempt says how much GPU memory it found free."""
    import torch

    from outlast import train
    from outlast.train.torch import get_device

    dev = get_device()
    attempt = int(os.environ["OUTLAST_ATTEMPT"])
    free, total = torch.cuda.mem_get_info(dev)
    emit(config, ev="start", free=free, total=total)
    w, start = torch.zeros(1024, device=dev), 0
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"), map_location=dev)
        w, start = saved["w"], saved["step"] + 1
    emit(config, ev="restored", step=start - 1)
    hog = torch.empty(int(config["hog_gb"] * 2**30), dtype=torch.uint8, device=dev)
    hog.fill_(1)
    import torch.distributed as dist

    for step in range(start, 20):
        w += 1
        if dist.get_world_size() > 1:  # a peer that dies leaves the others waiting in NCCL
            peers = torch.ones(1, device=dev)
            dist.all_reduce(peers)
        if attempt == 1 and step == 12 and train.get_context().get_world_rank() == config["kill_rank"]:
            emit(config, ev="kill")
            _die_mid_step(dev)
        if step % 5 == 4:
            with tempfile.TemporaryDirectory() as d:
                if train.get_context().get_world_rank() == 0:
                    torch.save({"w": w, "step": step}, os.path.join(d, "state.pt"))
                train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(d))
        else:
            train.report({"step": step})
        if step == start:
            emit(config, ev="first_step", step=step)
    emit(config, ev="done", w=w[0].item())


def oom_loop(config: dict) -> None:
    """Attempt 1 asks twice the GPU's memory: torch.cuda.OutOfMemoryError. Attempt 2 trains."""
    import torch

    from outlast import train
    from outlast.train.torch import get_device

    dev = get_device()
    if int(os.environ["OUTLAST_ATTEMPT"]) == 1:
        _, total = torch.cuda.mem_get_info(dev)
        torch.empty(2 * total, dtype=torch.uint8, device=dev)
    x = torch.ones(1 << 20, device=dev)
    train.report({"sum": x.sum().item()})
    emit(config, ev="done")


def save_loop(config: dict) -> None:
    """`gb` GB of CUDA tensors: save_async, then changed and saved again SYNC; both timed on the loop,
    then SIGKILL. Attempt 2 restores the latest onto the GPU and gives its digest."""
    import torch

    from outlast import train
    from outlast.train.torch import get_device, save_async

    dev = get_device()
    if int(os.environ["OUTLAST_ATTEMPT"]) > 1:
        with train.get_checkpoint().as_directory() as d:
            restored = torch.load(os.path.join(d, "state.pt"), map_location=dev)
        emit(config, ev="restored", digest=digest(restored), device=str(restored["t0"].device))
        return
    n = int(config["gb"] * 1e9) // 4 // 4
    g = torch.Generator(device=dev).manual_seed(1)
    state = {f"t{i}": torch.rand(n, device=dev, generator=g) for i in range(4)}
    torch.cuda.synchronize()
    first = digest(state)
    t = time.perf_counter()
    save_async(state, {"kind": "async"}, filename="state.pt")
    async_blocked = time.perf_counter() - t
    for v in state.values():
        v.add_(1.0)  # what the loop does next must not reach the saved copy
    second = digest(state)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        torch.save(state, os.path.join(d, "state.pt"))
        train.report({"kind": "sync"}, checkpoint=train.Checkpoint.from_directory(d))
    sync_blocked = time.perf_counter() - t  # torch.save, the upload, and the commit
    emit(config, ev="saved", async_digest=first, sync_digest=second, async_blocked_s=async_blocked,
         sync_blocked_s=sync_blocked, bytes=4 * n * 4)
    os.kill(os.getpid(), signal.SIGKILL)


def fsdp_loop(config: dict) -> None:
    """FSDP2 (fully_shard) on the GPU, a DCP save at step 5, SIGKILL in attempt 1, a DCP restore."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from outlast import train
    from outlast.train.torch import get_device

    dev = get_device()
    rank = train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(dev)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=d)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            with open(os.path.join(d, "step.json")) as f:
                start = json.load(f)["step"] + 1
        emit(config, ev="restored", step=start - 1, digest=digest(dict(model.state_dict())))
    for step in range(start, 10):
        x = torch.randn(64, 1024, device=dev, generator=torch.Generator(device=dev).manual_seed(step * 100 + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 5:
            with tempfile.TemporaryDirectory() as d:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)
                if rank == 0:
                    with open(os.path.join(d, "step.json"), "w") as f:
                        json.dump({"step": step}, f)
                train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(d))
            emit(config, ev="saved", step=step, digest=digest(dict(model.state_dict())))
            if int(os.environ["OUTLAST_ATTEMPT"]) == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            train.report({"step": step})
    emit(config, ev="done", digest=digest(dict(model.state_dict())))


def drain_loop(config: dict) -> None:
    """CUDA state of `gb` GB; on the drain's notice, Ray's just-in-time checkpoint (torch.save of the
    CUDA state, report); the restarted attempt restores it on its new node's GPU."""
    import torch

    from outlast import train
    from outlast.train.torch import get_device

    dev = get_device()
    node = os.environ.get("OUTLAST_NODE_ID")
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            restored = torch.load(os.path.join(d, "state.pt"), map_location=dev)
        emit(config, ev="restarted_step", node=node, digest=digest(restored))
        return
    g = torch.Generator(device=dev).manual_seed(2)
    state = {"w": torch.rand(int(config["gb"] * 1e9) // 4, device=dev, generator=g)}
    for step in range(1, 10**9):
        state["w"].mul_(1.0000001)
        torch.cuda.synchronize()
        emit(config, ev="step", step=step, node=node)
        if train.get_preemption_info() is None:
            train.report({"step": step})
            time.sleep(0.02)
            continue
        emit(config, ev="notice", step=step, digest=digest(state))
        with tempfile.TemporaryDirectory() as d:
            torch.save(state, os.path.join(d, "state.pt"))
            emit(config, ev="saved", step=step)
            train.report({"step": step, "preempted": 1}, checkpoint=train.Checkpoint.from_directory(d))
        return


def timing_loop(config: dict) -> None:
    """First step of each attempt, on the GPU or the CPU; SIGKILL at step 3 of attempt 1."""
    import torch

    from outlast import train
    from outlast.train.torch import get_device

    dev = get_device()
    x = torch.randn(256, 256, device=dev)
    for step in range(6):
        x = (x @ x).tanh()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if step == 0:
            emit(config, ev="first_step", device=str(dev))
        if step == 3 and int(os.environ["OUTLAST_ATTEMPT"]) == 1 and config.get("kill"):
            emit(config, ev="kill")
            os.kill(os.getpid(), signal.SIGKILL)
        train.report({"step": step})
