"""A live run's checkpoint, written in parts by the ranks and read back whole by each (`LiveTraining.save`/`load`).

Rank 0 writes the model's weights, the loop's `state` and the layout (`live.json`: the step saved, the number of
shards). The optimizer's state is rank 0's where it is whole; split between the ranks of each replica
(`shards=S`), each rank of the first replica, ranks 0 to S-1, writes the shard it holds, so that the checkpoint
holds every shard once. An FSDP2 model over `live_mesh` has its weights in shards as well: each of those ranks
writes its shard's weights beside its optimizer's state, and rank 0 no whole model. A checkpoint commits only when every rank reported it, so a part lost with its rank leaves
it uncommitted, never half there. A restore reads the layout first, and refuses a checkpoint of another layout (a
run restarted with another `shards`) or one that lacks this rank's shard before it loads anything.

The files are read with `torch.load(weights_only=True)`: tensors and plain data, never objects to construct.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable

import msgspec

LAYOUT = "live.json"
MODEL = "model.pt"
STATE = "state.pt"


class PartsLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    step: Annotated[int, msgspec.Meta(ge=0)]  # the committed step the checkpoint holds
    shards: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    model_sharded: bool = False  # the weights too are in shards (an FSDP2 model over live_mesh), one file each


def optimizer_file(shard: int, shards: int) -> str:
    return "optimizer.pt" if shards == 1 else f"optimizer-shard-{shard}-of-{shards}.pt"


def model_file(shard: int, shards: int, model_sharded: bool) -> str:
    return f"model-shard-{shard}-of-{shards}.pt" if model_sharded else MODEL


def parts(rank: int, shards: int, model_sharded: bool = False) -> list[str]:
    """The files world rank `rank` writes (the others write none): the first replica's ranks hold shards 0 to S-1."""
    files = [LAYOUT] + ([] if model_sharded else [MODEL]) + [STATE] if rank == 0 else []
    if rank < shards:
        files += [optimizer_file(rank, shards)] + ([model_file(rank, shards, True)] if model_sharded else [])
    return files


@dataclass(frozen=True)
class Restored:
    step: int  # the step to run next: the one after the checkpoint's
    model: dict[str, Any]
    optimizer: dict[str, Any]
    state: Any


def save(directory: str | Path, rank: int, step: int, shards: int, model: Callable[[], Any],
         optimizer: Callable[[], Any], state: Callable[[], Any], model_sharded: bool = False) -> bool:
    """Writes world rank `rank`'s part of the checkpoint of committed step `step` into `directory`; False when it
    has none to write. `model`, `optimizer` and `state` give each state dict (`optimizer`: of the shard this rank
    holds, or of the whole optimizer; `model`: of this rank's shard when `model_sharded`), asked only of the rank
    that writes it (`parts`)."""
    import torch

    if step < 0:
        raise ValueError(f"LiveTraining.save(step={step}): the step is the committed one, 0 or more")
    files = parts(rank, shards, model_sharded)
    content = {model_file(rank, shards, model_sharded): model, STATE: state, optimizer_file(rank, shards): optimizer}
    d = Path(directory)
    for name in files:
        if name == LAYOUT:
            (d / name).write_bytes(msgspec.json.encode(PartsLayout(step=step, shards=shards,
                                                                   model_sharded=model_sharded)))
        else:
            torch.save(content[name](), d / name)
    return bool(files)


def load(directory: str | Path, shard: int, shards: int, model_sharded: bool = False) -> Restored:
    """What a rank holding `shard` of `shards` restores from a live run's checkpoint in `directory`."""
    import torch

    d = Path(directory)
    try:
        layout = msgspec.json.decode((d / LAYOUT).read_bytes(), type=PartsLayout)
    except FileNotFoundError:
        raise FileNotFoundError(f"{d} has no {LAYOUT}: it is not a checkpoint LiveTraining.save wrote (rank 0 "
                                "writes it); load such a checkpoint in the loop itself") from None
    except msgspec.DecodeError as e:  # malformed, or of another shape (ValidationError)
        raise ValueError(f"{d / LAYOUT} is not a live checkpoint's layout ({e}): the checkpoint is damaged") from e
    if layout.shards != shards:
        raise ValueError(f"the checkpoint in {d} splits the optimizer's state in {layout.shards} shard(s) and this run "
                         f"in {shards}: restart it with LiveTraining(shards={layout.shards}), or load the checkpoint "
                         "in the loop itself")
    if layout.model_sharded != model_sharded:
        saved, now = ("in shards", "whole") if layout.model_sharded else ("whole", "in shards")
        raise ValueError(f"the checkpoint in {d} holds the model's weights {saved} and this run keeps them {now}: "
                         "load it with LiveTraining(mesh=live_mesh(...)) if and only if it was saved with one")
    model = model_file(shard, shards, model_sharded)
    read = {}
    for name in (model, STATE, optimizer_file(shard, shards)):
        try:
            read[name] = torch.load(d / name, weights_only=True)
        except FileNotFoundError:
            raise FileNotFoundError(f"the checkpoint in {d} lacks {name}: a rank that was to write it reported the "
                                    "step without it (each rank reports the part LiveTraining.save wrote)") from None
        except Exception as e:
            raise ValueError(f"{d / name} could not be read as tensors and plain data (torch.load(weights_only="
                             f"True)): {e}") from e
    return Restored(layout.step + 1, read[model], read[optimizer_file(shard, shards)], read[STATE])
