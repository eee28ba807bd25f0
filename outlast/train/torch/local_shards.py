"""An FSDP2 model's and optimizer's state as this rank's own pieces: what a holder of a shard sends a rank that
takes that shard up, and what `LiveTraining.save` writes of it.

A DTensor's state goes as its local tensor, which is all a rank holds and all a rank of the same shard needs: both
sides' parameters were sharded alike by the same mesh. Sending DTensors themselves would pickle their mesh and
placements, which the weights-only reader on the other side (rightly) refuses to build.
"""

from __future__ import annotations

from typing import Any


def _local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def model_state(model: Any) -> dict[str, Any]:
    return {name: _local(value) for name, value in model.state_dict().items()}


def load_model_state(model: Any, state: dict[str, Any]) -> None:
    """Each parameter's and buffer's local piece copied into the model's own, in place (FSDP2's sharded parameters
    are views of its buffers: replacing them would cut FSDP off from them)."""
    import torch

    own = model.state_dict()
    if set(own) != set(state):
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(f"the model's state sent does not match this rank's model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, value in own.items():
            local = _local(value)
            if local.shape != state[name].shape:
                raise ValueError(f"{name}: this rank's piece is {tuple(local.shape)}, the piece sent "
                                 f"{tuple(state[name].shape)}: the ranks sharded the model differently")
            local.copy_(state[name])


def optimizer_state(optimizer: Any) -> dict[str, Any]:
    d = optimizer.state_dict()
    return {"state": {index: {k: _local(v) for k, v in s.items()} for index, s in d["state"].items()},
            "param_groups": d["param_groups"]}


def load_optimizer_state(optimizer: Any, state: dict[str, Any]) -> None:
    """The optimizer's state from local pieces: each made a DTensor again as its parameter is (the same mesh and
    placements, and the parameter's global shape, which an uneven shard could not be told from)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    rebuilt: dict[Any, Any] = {}
    for index, s in state["state"].items():
        p = params[int(index)]
        rebuilt[index] = {k: (DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                 stride=p.stride())
                              if isinstance(p, DTensor) and getattr(v, "shape", None) == p.to_local().shape else v)
                          for k, v in s.items()}
    optimizer.load_state_dict({"state": rebuilt, "param_groups": state["param_groups"]})
