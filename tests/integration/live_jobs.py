"""A data-parallel loop under live recovery (FailureConfig(live_recovery=True)), for test_live_recovery.py."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import tempfile
import time

from outlast import train
from outlast.train import Checkpoint


def _log(config: dict, **fields) -> None:
    ctx = train.get_context()
    fields.update(rank=ctx.get_world_rank(), attempt=ctx.get_attempt(), pid=os.getpid(),
                  node=os.environ.get("OUTLAST_NODE_ID"),
                  incarnation=int(os.environ.get("OUTLAST_LIVE_INCARNATION", "0")), t=time.time())
    with open(config["events"], "a") as f:
        f.write(json.dumps(fields) + "\n")


def live_loop(config: dict) -> None:
    """Each step's batch is drawn from the step and the rank, so a step run again reads what it read first.
    `config["kill"]`: [[rank, step, how], ...]: each rank's first process of the first attempt SIGKILLs itself
    ("kill") or raises ("raise") after its backward of that step, its gradients not yet reduced. `config["report"]`: report() after each committed step.
    `config["die_in_transfer"]`: the incarnations whose process SIGKILLs itself while it receives the state, after
    its header (in the first attempt); `config["pad_mb"]`: megabytes of zeros in the state, so that the sender is
    still sending then. `config["notice"]`: ask get_preemption_info() at each step, and log the first notice.
    `config["until_generation"]`: train past `steps` until the live group reached that generation, and
    `config["after"]` steps in it (every rank, a new member too, sees it reached at the same step), so that a planned
    change made while the run trains always happens in it. `config["faults"]`: [[rank, step, point], ...]: that
    rank's first process of the first attempt SIGKILLs itself at the named fault point of that step ("forward":
    before it; "stop": it SIGSTOPs itself there instead, a hang). `config["checkpoint"]`: rank 0 reports a
    checkpoint with each committed step, uploaded in report(), which returns once the checkpoint is committed
    (every rank's report of it counted), and logs that it returned; "live": every rank reports its part of
    `LiveTraining.save` instead, and a restarted attempt restores the newest with `LiveTraining.load`.
    `config["shards"]`: the ranks split Adam's state in that many shards. `config["fsdp"]`: the model is FSDP2's over
    `live_mesh(shards=1)` (each rank a replica)."""
    import torch

    from outlast import faults
    from outlast.train.torch import LiveTraining, prepare_model

    if int(os.environ.get("OUTLAST_LIVE_INCARNATION", "0")) in config.get("die_in_transfer", []):
        os.environ["OUTLAST_FAULT_POINTS"] = "live.receive_state.after_header=kill"
        faults.reset()
    if config.get("fsdp"):
        model, optimizer = _model(fsdp=True)
        live = LiveTraining(model, optimizer, state=_Pad(config.get("pad_mb", 0)), mesh=model.live_mesh)
    elif config.get("shards", 1) > 1:  # the optimizer's state split: Adam's moments, built over this rank's shard
        torch.manual_seed(0)
        model = prepare_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
        live = LiveTraining(model, functools.partial(torch.optim.Adam, lr=0.01), state=_Pad(config.get("pad_mb", 0)),
                            shards=config["shards"])
    else:
        model, optimizer = _model()
        live = LiveTraining(model, optimizer, state=_Pad(config.get("pad_mb", 0)))
    rank = train.get_context().get_world_rank()
    step = _start(config, live)
    kill = {(k[0], k[1]): k[2] for k in config.get("kill") or []}
    first = train.get_context().get_attempt() == 1 and os.environ.get("OUTLAST_LIVE_INCARNATION") == "0"
    told = False
    until = config.get("until_generation", 0)
    reached = step if live.generation >= until else None
    faults_at = {(k[0], k[1]): k[2] for k in config.get("faults") or []}
    while step < config["steps"] or reached is None or step < reached + config.get("after", 0):
        if first and (rank, step) in faults_at:
            point = faults_at.pop((rank, step))
            if point in ("forward", "stop"):
                os.kill(os.getpid(), signal.SIGKILL if point == "forward" else signal.SIGSTOP)
            else:
                os.environ["OUTLAST_FAULT_POINTS"] = f"{point}=kill"
                faults.reset()
        if config.get("notice") and not told and (info := train.get_preemption_info()) is not None:
            told = True
            _log(config, event="notice", step=step, ranks=info.preempted_ranks, node_ids=info.preempted_node_ids)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 8, generator=g)
        with live.forward_backward():
            loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
            loss.backward()
        if first and (rank, step) in kill:
            if kill[rank, step] == "raise":
                raise RuntimeError(f"rank {rank} fails in step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(config.get("sleep", 0.02))
        was = step
        step = live.step(step)
        if reached is None and live.generation >= until:
            reached = step
        _log(config, event="step" if step == was + 1 else "thrown", step=was)
        if config.get("report") and step == was + 1:
            if config.get("checkpoint") == "live":
                with tempfile.TemporaryDirectory() as d:
                    part = live.save(d, was)
                    train.report({"step": was}, checkpoint=Checkpoint.from_directory(d) if part else None)
            elif config.get("checkpoint") and rank == 0:
                with tempfile.TemporaryDirectory() as d:
                    torch.save(model.state_dict(), os.path.join(d, "model.pt"))
                    train.report({"step": was}, checkpoint=Checkpoint.from_directory(d))
                _log(config, event="reported", step=was)  # committed: report() returned
            else:
                train.report({"step": was})
    live.close()
    _log(config, event="end", exact=_exact(model), world=train.get_context().get_world_size())


def _start(config: dict, live) -> int:
    """`live.start()`, from the newest checkpoint of `LiveTraining.save` when `config["checkpoint"] == "live"` and
    the attempt has one; logged."""
    restored = 0
    if config.get("checkpoint") == "live" and (checkpoint := train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            restored = live.load(d)
    step = live.start(restored)
    _log(config, event="start", step=step)
    return step


def _exact(model) -> list:
    """The weights as lists of numbers: this rank's pieces of an FSDP2 model's."""
    return [(p.to_local() if hasattr(p, "to_local") else p).reshape(-1).tolist() for p in model.state_dict().values()]


class _Pad:
    """Zeros that a replacement receives with the model: a state large enough that its transfer takes a while."""

    def __init__(self, mb: int) -> None:
        import torch

        self.pad = torch.zeros(mb * 2**20, dtype=torch.uint8)

    def state_dict(self) -> dict:
        return {"pad": self.pad}

    def load_state_dict(self, d: dict) -> None:
        self.pad = d["pad"]


class _Epoch:
    """The loop's own state beside the model: the epoch it is in, which a replacement receives with the rest."""

    def __init__(self) -> None:
        self.epoch = 0
        self.running = False  # inside an epoch the loop decided to run (a rank that joins mid-epoch runs it too)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "running": self.running}

    def load_state_dict(self, d: dict) -> None:
        self.epoch, self.running = d["epoch"], d.get("running", False)


def live_loader_loop(config: dict) -> None:
    """A loop fed by prepare_data_loader (a shuffled DataLoader of `rows` rows, `batch` a batch), `epochs` epochs,
    each batch's row ids logged with the step that applied them ("thrown": a step a live shrink threw away).
    `config["kill"]`: [[rank, step], ...]: that rank's first process of the first attempt SIGKILLs itself after its
    backward of that step. `config["fsdp"]`: the model is FSDP2's over `live_mesh(shards=1)` (each rank a replica),
    its forward and backward inside `live.forward_backward()`."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from outlast.train.torch import prepare_data_loader

    model, optimizer = _model(config.get("fsdp", False))
    x = torch.randn(config["rows"], 8, generator=torch.Generator().manual_seed(7))
    loader = prepare_data_loader(DataLoader(TensorDataset(torch.arange(config["rows"]), x),
                                            batch_size=config["batch"], shuffle=True))

    def epoch_batches(epoch: int):
        loader.sampler.set_epoch(epoch)
        return loader

    _live_epochs(config, model, optimizer, epoch_batches)


def _model(fsdp: bool = False):
    import torch

    from outlast.train.torch import prepare_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        from outlast.train.torch import live_mesh

        model.live_mesh = live_mesh(shards=1)
        fully_shard(model, mesh=model.live_mesh)
    else:
        model = prepare_model(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _live_epochs(config: dict, model, optimizer, epoch_batches) -> None:
    """The loop of live_loader_loop and live_shard_loop: each batch of `epoch_batches(epoch)` (row ids, features)
    trained and logged, epoch after epoch (`_more_epochs`), through LiveTraining."""
    from outlast.train.torch import LiveTraining

    epoch = _Epoch()
    live = LiveTraining(model, optimizer, state=epoch, mesh=getattr(model, "live_mesh", None))
    rank = train.get_context().get_world_rank()
    step = live.start()
    _log(config, event="start", step=step, epoch=epoch.epoch)
    kill = {(k[0], k[1]) for k in config.get("kill") or []}
    first = train.get_context().get_attempt() == 1 and os.environ.get("OUTLAST_LIVE_INCARNATION") == "0"
    while _more_epochs(config, epoch, live):
        for ids, xb in epoch_batches(epoch.epoch):
            with live.forward_backward():
                ((model(xb) - xb.sum(dim=1, keepdim=True)) ** 2).mean().backward()
                if first and (rank, step) in kill:
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(config.get("sleep", 0.01))
            was = step
            # Logged before it is reduced too: a process lost after the step's commit never logs the step.
            _log(config, event="batch", step=was, epoch=epoch.epoch, rows=ids.tolist())
            try:
                step = live.step(step)
            except SystemExit:
                _log(config, event="left", step=was)  # a drained rank the group went on without: its batch unused
                raise
            _log(config, event="step" if step == was + 1 else "thrown", step=was, epoch=epoch.epoch,
                 rows=ids.tolist())
        epoch.epoch += 1
        epoch.running = False
    exact = _exact(model)
    live.close()
    _log(config, event="end", exact=exact, world=train.get_context().get_world_size())


def _more_epochs(config: dict, epoch, live) -> bool:
    """Another epoch: `config["epochs"]` of them, and with `config["until_generation"]`, on until the live group has
    reached that generation (a grow that takes its time under load), at most 40 epochs. The ranks decide at an
    epoch's start, all after the same step, where the generation is the same on every rank; a rank that joins
    mid-epoch finds the decision in the state it was sent (`running`), and runs the epoch to its end."""
    if not epoch.running:
        # The generation formed, not one due: a loop that stopped at an epoch's end with a grow due would form it
        # in close(), and the ranks that joined would run no step.
        formed = live.rank.ledger.generation
        epoch.running = epoch.epoch < config["epochs"] or formed < config.get("until_generation", 0)
        if epoch.running and epoch.epoch >= 40:
            raise RuntimeError(f"generation {config['until_generation']} not reached in 40 epochs")
    return epoch.running


def live_shard_loop(config: dict) -> None:
    """live_loader_loop's, fed by get_dataset_shard("train") (`rows` rows of an id and 8 features, each rank's share
    shuffled without a seed of the loop's)."""
    model, optimizer = _model()
    batches = train.get_dataset_shard("train").iter_torch_batches(
        batch_size=config["batch"], local_shuffle_buffer_size=config["rows"], device="cpu")
    _live_epochs(config, model, optimizer, lambda epoch: ((b["i"], b["x"]) for b in batches))


def live_custom_sampler_loop(config: dict) -> None:
    """prepare_data_loader of a DataLoader with a sampler of its own, under live recovery."""
    import torch
    from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

    from outlast.train.torch import prepare_data_loader

    prepare_data_loader(DataLoader(TensorDataset(torch.arange(8)), batch_size=2,
                                   sampler=SubsetRandomSampler(range(8))))


def live_fsdp_loop(config: dict) -> None:
    """An FSDP2 model (three linear layers, each `fully_shard`ed, then the whole) over `live_mesh(shards=2)`, Adam,
    its gradients clipped (a DTensor's functional collectives), each step's batch drawn from the step and the rank.
    `config["kill"]`: [[rank, step, where], ...]: that rank's first process of the first attempt SIGKILLs itself in
    that step's forward ("forward": in the second layer, its first layer's parameters gathered), in its backward
    ("backward": in the second layer's, the third's gradients reduced) or at a fault point of live recovery
    (`live.vote`, `live.optimizer_step`); "stop-backward": it SIGSTOPs itself there instead, a hang; at step -1,
    "live.attach": as its first generation's mesh groups form. `config["checkpoint"] == "live"`: every rank reports its part of
    `LiveTraining.save` with each step, and a restarted attempt restores the newest. `config["unguarded"]`: the
    forward and backward run outside `live.forward_backward()`. Each rank logs its own pieces of the weights at the
    end ("exact")."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from outlast import faults
    from outlast.train.torch import LiveTraining, live_mesh

    rank = train.get_context().get_world_rank()
    first = train.get_context().get_attempt() == 1 and os.environ.get("OUTLAST_LIVE_INCARNATION") == "0"
    kill = {k[1]: k[2] for k in config.get("kill") or [] if k[0] == rank} if first else {}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1))
    mesh = live_mesh(shards=config.get("shards", 2))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    live = LiveTraining(model, torch.optim.Adam(model.parameters(), lr=0.01), mesh=mesh)
    step_now = [0]

    def die(where: str):
        def hook(*_):
            how = kill.get(step_now[0])
            if how == where:
                os.kill(os.getpid(), signal.SIGKILL)
            elif how == f"stop-{where}":
                os.kill(os.getpid(), signal.SIGSTOP)  # a hang: its sockets stay open
        return hook

    model[2].register_forward_pre_hook(die("forward"))
    model[2].register_full_backward_pre_hook(die("backward"))
    if kill.get(-1) == "live.attach":  # its first generation's mesh groups: the others wait for it in the store
        os.environ["OUTLAST_FAULT_POINTS"] = "live.attach=kill"
        faults.reset()
    step = _start(config, live)
    while step < config["steps"]:
        step_now[0] = step
        if kill.get(step) in ("live.vote", "live.optimizer_step"):
            os.environ["OUTLAST_FAULT_POINTS"] = f"{kill.pop(step)}=kill"
            faults.reset()
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 8, generator=g)
        with live.forward_backward() if not config.get("unguarded") else contextlib.nullcontext():
            loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        was = step
        step = live.step(step)
        _log(config, event="step" if step == was + 1 else "thrown", step=was)
        if step == was + 1:
            if config.get("checkpoint") == "live":
                with tempfile.TemporaryDirectory() as d:
                    part = live.save(d, was)
                    train.report({"step": was}, checkpoint=Checkpoint.from_directory(d) if part else None)
            else:
                train.report({"step": was})
    pieces = [p.to_local().reshape(-1).tolist() for p in model.parameters()]
    live.close()
    _log(config, event="end", exact=pieces, world=train.get_context().get_world_size())
