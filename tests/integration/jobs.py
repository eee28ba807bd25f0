"""Train functions for the integration tests, importable by the workers.

Each appends JSON lines to `config["events"]` so a test can see what every rank did,
in every attempt, after the run is over.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time

from outlast import train
from outlast.train import Checkpoint


def log_event(config: dict, **fields) -> None:
    ctx = train.get_context()
    fields.update(rank=ctx.get_world_rank(), attempt=ctx.get_attempt(), pid=os.getpid(), ppid=os.getppid(),
                  t=time.time())
    with open(config["events"], "a") as f:
        f.write(json.dumps(fields) + "\n")


def read_events(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _fault(config: dict, step: int, when: str) -> None:
    """Inject the fault `config["fault"]` describes, in the first attempt only."""
    fault = config.get("fault")
    ctx = train.get_context()
    if not fault or fault["when"] != when or fault["step"] != step or fault["rank"] != ctx.get_world_rank():
        return
    if ctx.get_attempt() > fault.get("attempts", 1):
        return
    log_event(config, event="fault", step=step, kind=fault["kind"])
    if fault["kind"] == "raise":
        raise RuntimeError(f"injected failure at step {step}")
    if fault["kind"] == "hold":  # until the test kills it: no checkpoint after this step commits meanwhile
        time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


def _restored_start() -> tuple[int, Checkpoint | None]:
    """The step to start at (after the restored checkpoint's `state.json` step), and that checkpoint."""
    ckpt = train.get_checkpoint()
    if ckpt is None:
        return 0, None
    with ckpt.as_directory() as d:
        with open(os.path.join(d, "state.json")) as f:
            return json.load(f)["step"] + 1, ckpt


def counting_loop(config: dict) -> None:
    """No torch: a step counter checkpointed every `every` steps as a JSON file."""
    ctx = train.get_context()
    start, ckpt = _restored_start()
    log_event(config, event="start", restored_step=start - 1 if ckpt else None)
    for step in range(start, config["steps"]):
        train.collective.barrier()  # keeps ranks in lock step, like a gradient all-reduce would
        _fault(config, step, "before_report")
        checkpoint = None
        shard = config.get("sharded", False)
        if (step + 1) % config.get("every", 5) == 0 and (shard or ctx.get_world_rank() == 0):
            d = tempfile.mkdtemp()
            name = f"state_rank{ctx.get_world_rank()}.json" if shard else "state.json"
            with open(os.path.join(d, name), "w") as f:
                json.dump({"step": step}, f)
            if config.get("pad_bytes"):
                with open(os.path.join(d, "pad.bin"), "wb") as f:
                    f.write(os.urandom(config["pad_bytes"]))
            if shard and ctx.get_world_rank() == 0:
                with open(os.path.join(d, "state.json"), "w") as f:
                    json.dump({"step": step}, f)
            checkpoint = Checkpoint.from_directory(d)
        # `named`: every report names its directory, as Ray's scripts may (checkpoint_dir_name="step_9").
        name = f"step_{step}" if config.get("named") and (step + 1) % config.get("every", 5) == 0 else None
        train.report({"step": step}, checkpoint=checkpoint, checkpoint_upload_mode=config.get("upload_mode", "SYNC"),
                     checkpoint_dir_name=name)
        if checkpoint is not None and config.get("delete_after_report"):
            shutil.rmtree(checkpoint.path)  # Ray's pattern: a temporary directory, gone once report() returns
        log_event(config, event="step", step=step, checkpointed=checkpoint is not None)
        _fault(config, step, "after_report")
        time.sleep(config.get("step_sleep", 0.0))
    if config.get("end_when"):  # a file the test writes once it has looked at the nodes while the run lives
        deadline = time.time() + 120
        while not os.path.exists(config["end_when"]) and time.time() < deadline:
            time.sleep(0.05)
    log_event(config, event="end")


def _restore_torch(ckpt, model, opt, filename: str) -> int:
    """Load model and optimizer from `ckpt` (if any); return the step to continue from."""
    if ckpt is None:
        return 0
    import torch

    with ckpt.as_directory() as d:
        state = torch.load(os.path.join(d, filename))
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return state["step"] + 1


def ddp_loop(config: dict) -> None:
    """A small torch model under DistributedDataParallel, checkpointed every `every` steps."""
    import torch

    from outlast.train.torch import prepare_model

    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = train.get_checkpoint()
    start = _restore_torch(ckpt, model, opt, "model.pt")
    log_event(config, event="start", restored_step=start - 1 if ckpt else None)
    gen = torch.Generator().manual_seed(1234 + train.get_context().get_world_rank())
    for step in range(start, config["steps"]):
        x = torch.randn(16, 8, generator=gen)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        _fault(config, step, "before_report")
        checkpoint = None
        if (step + 1) % config.get("every", 5) == 0 and train.get_context().get_world_rank() == 0:
            d = tempfile.mkdtemp()
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                       os.path.join(d, "model.pt"))
            checkpoint = Checkpoint.from_directory(d)
        train.report({"step": step, "loss": loss.item()}, checkpoint=checkpoint)
        log_event(config, event="step", step=step, checkpointed=checkpoint is not None)
        _fault(config, step, "after_report")
    log_event(config, event="end")


def sleepy_loop(config: dict) -> None:
    """Reports slowly until killed from outside."""
    log_event(config, event="start", restored_step=None)
    for step in range(config["steps"]):
        time.sleep(0.05)
        train.report({"step": step})


def collective_loop(config: dict) -> None:
    ctx = train.get_context()
    got = train.collective.broadcast_from_rank_zero({"from": ctx.get_world_rank(), "seed": 42}
                                                    if ctx.get_world_rank() == 0 else None)
    log_event(config, event="broadcast", value=got)
    if ctx.get_world_rank() in config.get("skip_barrier", []):
        time.sleep(config.get("sleep", 0))
        return
    train.collective.barrier()
    log_event(config, event="barrier")


def _kill(kind: str) -> None:
    """SIGKILL this worker ("kill"), its fork server ("forkserver": the worker's parent) or its node
    agent ("agent": the fork server's parent); the worker dies with the fork server either way."""
    import psutil

    pid = {"kill": os.getpid(), "forkserver": os.getppid()}.get(kind) or psutil.Process(os.getppid()).ppid()
    os.kill(pid, signal.SIGKILL)
    time.sleep(60)  # the kernel's signal to a fork server's children arrives in a moment


def deterministic_model(ckpt):
    """The deterministic loops' model under DDP and its optimizer, both restored from `ckpt` when there is
    one: (model, optimizer, the step to start at)."""
    import torch

    from outlast.train.torch import prepare_model

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt, _restore_torch(ckpt, model, opt, "state.pt")


def deterministic_step(model, opt, step: int, rank: int) -> None:
    """One training step on a batch drawn from a seed of (step, rank): the same step trains the same way
    in whichever attempt takes it."""
    import torch

    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, 8, generator=g)
    loss = ((model(x) - torch.sin(x.sum(dim=1, keepdim=True))) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def torch_checkpoint(model, opt, step: int) -> Checkpoint:
    """A checkpoint of the model and optimizer after `step`, as `_restore_torch` reads it back."""
    import torch

    d = tempfile.mkdtemp()
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, os.path.join(d, "state.pt"))
    return Checkpoint.from_directory(d)


def weights_digest(model) -> str:
    """sha256 of the model's weights, name by name: equal digests are bit-for-bit equal weights."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(model.module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().numpy().tobytes())
    return digest.hexdigest()


def deterministic_ddp_loop(config: dict) -> None:
    """Training as a pure function of (restored state, step): a restart redoes steps bit for bit.

    `config["faults"]` lists [attempt, rank, offset, kind]: in that attempt, that rank dies `offset`
    steps after the step it started from (kind: "raise", "kill", "forkserver", "agent").
    At the end rank 0 logs a digest of the weights.
    """
    ctx = train.get_context()
    rank = ctx.get_world_rank()
    model, opt, start = deterministic_model(train.get_checkpoint())
    for step in range(start, config["steps"]):
        for attempt, f_rank, offset, kind in config.get("faults", []):
            if (attempt, f_rank, start + offset) == (ctx.get_attempt(), rank, step):
                if kind == "raise":
                    raise RuntimeError(f"chaos at step {step}")
                _kill(kind)
        deterministic_step(model, opt, step, rank)
        checkpoint = torch_checkpoint(model, opt, step) if (step + 1) % config["every"] == 0 and rank == 0 else None
        train.report({"step": step}, checkpoint=checkpoint)
    if rank == 0:
        log_event(config, event="weights", digest=weights_digest(model))


def data_loader_loop(config: dict) -> None:
    """Which samples each rank sees through prepare_data_loader, and what prepare_model returns."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from outlast.train.torch import get_device, prepare_data_loader, prepare_model

    dataset = TensorDataset(torch.arange(40, dtype=torch.float32).unsqueeze(1))
    loader = prepare_data_loader(DataLoader(dataset, batch_size=4, shuffle=True))
    loader.sampler.set_epoch(0)
    seen = [int(v) for (batch,) in loader for v in batch.flatten().tolist()]
    model = prepare_model(torch.nn.Linear(1, 1))
    log_event(config, event="samples", seen=seen, device=str(get_device()), wrapped=type(model).__name__)


def settled_model_loop(config: dict) -> None:
    """What prepare_model's settling of DDP's buckets leaves behind: the model's own forward and hooks not run, its
    buffers as they were, no gradient; then two steps train as usual (with `config["ddp"]` passed to DDP)."""
    import torch

    from outlast.train.torch import prepare_model

    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    calls = []
    inner.register_forward_hook(lambda *args: calls.append(1))
    buffers = {k: v.clone() for k, v in inner.state_dict().items() if "running" in k}
    model = prepare_model(inner, parallel_strategy_kwargs=config.get("ddp"))
    seen = {"forward_calls": len(calls), "grads": [p.grad is not None for p in model.parameters()],
            "buffers_unchanged": all(torch.equal(inner.state_dict()[k], v) for k, v in buffers.items())}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss = model(torch.randn(6, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    seen["forward_calls_after_two_steps"] = len(calls)
    log_event(config, event="settled", **seen)


def preemptible_loop(config: dict) -> None:
    """Asks get_preemption_info() every step; on a notice, saves one just-in-time checkpoint and goes on.
    `every`: rank 0 also checkpoints every that many steps."""
    ctx = train.get_context()
    start, ckpt = _restored_start()
    log_event(config, event="start", restored_step=start - 1 if ckpt else None,
              node_id=os.environ.get("OUTLAST_NODE_ID"))
    saved = False
    for step in range(start, config["steps"]):
        train.collective.barrier()  # lock step, as a gradient all-reduce would
        info = train.get_preemption_info()
        checkpoint = None
        regular = config.get("every") and (step + 1) % config["every"] == 0
        if regular and ctx.get_world_rank() == 0:
            d = tempfile.mkdtemp()
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"step": step}, f)
            checkpoint = Checkpoint.from_directory(d)
        if info is not None and not saved:
            saved = True
            log_event(config, event="notice", step=step, call=step - start, node_ids=info.node_ids,
                      ranks=info.ranks, deadline_ms=info.deadline_ms, reason=info.reason)
            if ctx.get_world_rank() == 0:
                d = tempfile.mkdtemp()
                with open(os.path.join(d, "state.json"), "w") as f:
                    json.dump({"step": step}, f)
                if config.get("pad_bytes"):  # a checkpoint large enough to take its time in storage
                    with open(os.path.join(d, "pad.bin"), "wb") as f:
                        f.write(os.urandom(config["pad_bytes"]))
                checkpoint = Checkpoint.from_directory(d)
        train.report({"step": step}, checkpoint=checkpoint)
        log_event(config, event="step", step=step)
        time.sleep(config.get("step_sleep", 0.0))


def relaxed_loop(config: dict) -> None:
    """For relax_collectives_on_preemption: on a notice, the preempted ranks stop reporting (their node
    is about to vanish) and the survivors save one checkpoint: the lowest survivor alone
    (replicated), or every survivor its own shard (`sharded`)."""
    ctx = train.get_context()
    rank = ctx.get_world_rank()
    start, ckpt = _restored_start()
    log_event(config, event="start", restored_step=start - 1 if ckpt else None,
              node_id=os.environ.get("OUTLAST_NODE_ID"))
    sharded = config.get("sharded", False)
    for step in range(start, config["steps"]):
        train.collective.barrier()
        info = train.get_preemption_info()
        save = (step + 1) % config.get("every", 1000) == 0
        if info is not None:
            log_event(config, event="notice", step=step, node_ids=info.node_ids, ranks=info.ranks)
            if rank in info.ranks:
                time.sleep(3600)  # its node is going away; the test takes it
            survivors = sorted(set(range(ctx.get_world_size())) - set(info.ranks))
            save = sharded or rank == survivors[0]
        checkpoint = None
        if save and (sharded or info is not None or rank == 0):
            d = tempfile.mkdtemp()
            with open(os.path.join(d, f"shard_{rank}.json" if sharded else "state.json"), "w") as f:
                json.dump({"step": step}, f)
            if sharded and rank == (0 if info is None else min(set(range(ctx.get_world_size())) - set(info.ranks))):
                with open(os.path.join(d, "state.json"), "w") as f:
                    json.dump({"step": step}, f)
            checkpoint = Checkpoint.from_directory(d)
        try:
            train.report({"step": step}, checkpoint=checkpoint)
        except train.CheckpointCommitError as e:
            log_event(config, event="commit_failed", step=step, error=str(e))
            raise
        log_event(config, event="step", step=step, checkpointed=checkpoint is not None)
        if info is not None:
            log_event(config, event="saved", step=step)
            time.sleep(3600)  # the controller restarts the run once the checkpoint is committed
        time.sleep(config.get("step_sleep", 0.0))
    log_event(config, event="end")


def node_logging_loop(config: dict) -> None:
    """`preemptible_loop`, also saying which node each rank runs on."""
    log_event(config, event="placed", node_id=os.environ.get("OUTLAST_NODE_ID"),
              local_rank=train.get_context().get_local_rank(), node_rank=train.get_context().get_node_rank())
    preemptible_loop(config)


def ddp_slow_preemptible_loop(config: dict) -> None:
    """The guide's just-in-time pattern in a DDP loop whose steps are long (`step_s`): every step asks
    get_preemption_info(); the first notice makes rank 0 save model and step; each call is logged."""
    import torch

    from outlast.train.torch import prepare_model

    ctx = train.get_context()
    log_event(config, event="placed", node_id=os.environ.get("OUTLAST_NODE_ID"))
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = train.get_checkpoint()
    start = _restore_torch(ckpt, model, opt, "model.pt")
    log_event(config, event="start", restored_step=start - 1 if ckpt else None)
    saved, call = False, 0
    for step in range(start, config["steps"]):
        began = time.monotonic()
        loss = model(torch.ones(2, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # the gradient all-reduce keeps the ranks in lock step
        opt.step()
        time.sleep(max(0.0, config["step_s"] - (time.monotonic() - began)))
        info = train.get_preemption_info()
        log_event(config, event="call", step=step, call=call, notice=info is not None)
        call += 1
        checkpoint = None
        if info is not None and not saved:
            saved = True
            log_event(config, event="notice", step=step, node_ids=info.node_ids, ranks=info.ranks)
            if ctx.get_world_rank() == 0:
                d = tempfile.mkdtemp()
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                           os.path.join(d, "model.pt"))
                checkpoint = Checkpoint.from_directory(d)
        train.report({"step": step}, checkpoint=checkpoint)
        log_event(config, event="step", step=step)


def save_async_loop(config: dict) -> None:
    """A tensor counter saved with `outlast.train.torch.save_async` every `every` steps. Right
    after each save the loop overwrites the tensor in place: the checkpoint must hold the
    value of the step it was saved at, not what the loop did next."""
    import torch

    from outlast.train.torch import save_async

    ctx = train.get_context()
    state = {"weights": torch.zeros(1000), "step": -1}
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "model.pt"))
    log_event(config, event="start", restored_step=state["step"] if ckpt else None,
              restored_weights=float(state["weights"][0]) if ckpt else None)
    for step in range(state["step"] + 1, config["steps"]):
        train.collective.barrier()
        if config.get("committed_before") == step and ctx.get_attempt() == 1:
            _await_a_manifest(config["run_dir"])  # the fault below is meant to find a checkpoint to restore
        _fault(config, step, "before_report")
        state["weights"].fill_(float(step))
        state["step"] = step
        if (step + 1) % config.get("every", 5) == 0 and ctx.get_world_rank() == 0:
            save_async(state, {"step": step}, filename="model.pt")
            state["weights"].fill_(-1.0)  # the loop goes on changing the tensors at once
        else:
            train.report({"step": step})


def _await_a_manifest(run_dir: str, timeout: float = 120.0) -> None:
    import glob

    deadline = time.monotonic() + timeout
    while not glob.glob(os.path.join(run_dir, "checkpoint_*", ".outlast-manifest.json")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint of {run_dir} was committed in {timeout:.0f} s")
        time.sleep(0.01)


def threads_loop(config: dict) -> None:
    """Say how many threads this rank's torch and OpenMP run."""
    import torch

    log_event(config, event="threads", torch=torch.get_num_threads(), interop=torch.get_num_interop_threads(),
              omp=os.environ.get("OMP_NUM_THREADS"))


def fit_counting(storage_path, events, *, steps: int = 10, storage: str = "storage", fault: dict | None = None,
                 every: int = 3, pad_bytes: int = 0):
    """`counting_loop` on 2 ranks spread over the nodes, each writing its own files (`pad_bytes` more each),
    checkpointing every `every` steps at the level `storage`, with one retry."""
    from outlast.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, Trainer

    config = {"events": str(events), "steps": steps, "every": every, "sharded": True, "delete_after_report": True,
              "step_sleep": 0.05, "pad_bytes": pad_bytes}
    if fault is not None:
        config["fault"] = fault
    return Trainer(counting_loop, train_loop_config=config,
                   scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
                   run_config=RunConfig(name="run", storage_path=storage_path,
                                        failure_config=FailureConfig(max_failures=1),
                                        checkpoint_config=CheckpointConfig(checkpoint_storage=storage))).fit()
