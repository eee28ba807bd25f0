"""The header of a live state transfer (its nesting, its non-tensor values, each tensor's dtype and shape)
comes over a group whose store and sockets anyone on the host can reach: it is read by torch's weights-only
unpickler, which builds what a state holds and refuses a pickle that would call anything."""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict

import pytest
import torch

from outlast.train.live.state_transfer import digest, join, read_header, split


def test_a_models_and_optimizers_state_with_its_rng_and_counters_comes_back_whole():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
             "reports": 7, "python": (3, [1.5, None, True], "s", b"b")}
    header, tensors = split(state)
    back = join(header, [t.clone() for t in tensors], digest(header, tensors))
    assert isinstance(back["model"], OrderedDict) and list(back["model"]) == list(state["model"])
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert torch.equal(back["rng"], state["rng"]) and back["reports"] == 7
    assert back["python"] == (3, [1.5, None, True], "s", b"b")


class Payload:
    def __reduce__(self):
        return (print, ("ran code",))


@pytest.mark.parametrize("made_by", ["pickle", "torch.save"])
def test_a_header_that_would_call_a_function_is_refused_before_anything_runs(made_by, capsys):
    if made_by == "pickle":
        hostile = pickle.dumps({"model": Payload()}, protocol=2)
    else:
        buffer = io.BytesIO()
        torch.save({"model": Payload()}, buffer)
        hostile = buffer.getvalue()
    with pytest.raises(pickle.UnpicklingError):
        read_header(hostile)
    assert "ran code" not in capsys.readouterr().out
