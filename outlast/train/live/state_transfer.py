"""A state dict sent from a rank that kept it to a rank that joined, checked against its checksum.

The state is serialised with `torch.save` into one buffer; a header (length and digest) goes
first, so the receiver sizes its buffer and checks what came against what was sent. The digest
is outlast's checksum (`outlast.storage.checksum`, xxh3-128): 100 MB in 0.02 s here, where
SHA-256 took 0.23 s on each side of the transfer.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from outlast.storage.checksum import ALGORITHM, new_hasher
from outlast.train.live.group import LiveGroup

if TYPE_CHECKING:
    import torch

HEADER_TAG, BODY_TAG = 7301, 7302
DIGEST_MAX = 32  # bytes of digest the header has room for


class StateTransferCorrupt(RuntimeError):
    """The state received does not match the checksum its sender computed."""


def pack(state: Any) -> tuple[torch.Tensor, bytes]:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    view = buf.getbuffer()  # hashed and sent in place: 100 MB copied is a tenth of a second
    return torch.frombuffer(view, dtype=torch.uint8), _digest(view)


def _digest(data) -> bytes:
    hasher = new_hasher(ALGORITHM)
    hasher.update(data)
    return hasher.digest()


def unpack(body: torch.Tensor, digest: bytes) -> Any:
    import torch

    data = body.numpy()
    got = _digest(data)
    if got != digest:
        raise StateTransferCorrupt(f"state of {data.nbytes} bytes has checksum {got.hex()} ({ALGORITHM}), its sender's was "
                                   f"{digest.hex()}: the transfer is void; take it again")
    return torch.load(io.BytesIO(data.data), weights_only=False)


def send_state(group: LiveGroup, state: Any, to_rank: int) -> int:
    """Returns the bytes sent."""
    import torch

    body, digest = pack(state)
    header = torch.tensor([body.numel(), len(digest), *digest.ljust(DIGEST_MAX, b"\0")], dtype=torch.int64)
    group.send(header, to_rank, HEADER_TAG)
    group.send(body, to_rank, BODY_TAG)
    return body.numel()


def receive_state(group: LiveGroup, from_rank: int) -> tuple[Any, int]:
    """The state and its size in bytes."""
    import torch

    header = torch.zeros(2 + DIGEST_MAX, dtype=torch.int64)
    group.recv(header, from_rank, HEADER_TAG)
    body = torch.empty(int(header[0]), dtype=torch.uint8)
    group.recv(body, from_rank, BODY_TAG)
    digest = bytes(int(b) for b in header[2:2 + int(header[1])])
    return unpack(body, digest), body.numel()
