"""A state dict sent from a rank that kept it to a rank that joined, checked against its SHA-256.

The state is serialised with `torch.save` into one buffer; a header (length and digest) goes
first, so the receiver sizes its buffer and checks what came against what was sent.
"""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING, Any

from outlast.train.live.group import LiveGroup

if TYPE_CHECKING:
    import torch

HEADER_TAG, BODY_TAG = 7301, 7302


class StateTransferCorrupt(RuntimeError):
    """The state received does not match the checksum its sender computed."""


def pack(state: Any) -> tuple[torch.Tensor, bytes]:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    view = buf.getbuffer()  # hashed and sent in place: 100 MB copied is a tenth of a second
    return torch.frombuffer(view, dtype=torch.uint8), hashlib.sha256(view).digest()


def unpack(body: torch.Tensor, digest: bytes) -> Any:
    import torch

    data = body.numpy()
    got = hashlib.sha256(data).digest()
    if got != digest:
        raise StateTransferCorrupt(f"state of {data.nbytes} bytes has SHA-256 {got.hex()[:16]}..., its sender's was "
                                   f"{digest.hex()[:16]}...: the transfer is void; take it again")
    return torch.load(io.BytesIO(data.data), weights_only=False)


def send_state(group: LiveGroup, state: Any, to_rank: int) -> int:
    """Returns the bytes sent."""
    import torch

    body, digest = pack(state)
    header = torch.tensor([body.numel(), *digest], dtype=torch.int64)
    group.send(header, to_rank, HEADER_TAG)
    group.send(body, to_rank, BODY_TAG)
    return body.numel()


def receive_state(group: LiveGroup, from_rank: int) -> tuple[Any, int]:
    """The state and its size in bytes."""
    import torch

    header = torch.zeros(33, dtype=torch.int64)
    group.recv(header, from_rank, HEADER_TAG)
    body = torch.empty(int(header[0]), dtype=torch.uint8)
    group.recv(body, from_rank, BODY_TAG)
    return unpack(body, bytes(int(b) for b in header[1:])), body.numel()
