"""A state dict sent from a rank that kept it to a rank that joined, checked against its checksum.

The state's tensors go over the group as they lie in memory, one send each; everything else
(the nesting, the non-tensor values, each tensor's dtype and shape) goes first, pickled, in a
small header. The header is read with torch's weights-only unpickler, which builds numbers,
strings, containers and dtypes and calls nothing else: the group's store and sockets are not
authenticated, and a header from whoever reached them must not run code in the rank. A state
holding values of other types names them with `torch.serialization.add_safe_globals`. Nothing is serialised into one buffer first: on this project's machines a
100 MB copy costs a tenth of a second, and `torch.save` then `torch.load` made three of them.

The digest is outlast's checksum (`outlast.storage.checksum`, xxh3-128; SHA-256 took ten times
as long), over the header and every tensor's bytes in order. It goes last; the joiner checks it
before the state is loaded, and a mismatch raises `StateTransferCorrupt`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from outlast.faults import fault_point
from outlast.storage.checksum import ALGORITHM, new_hasher
from outlast.train.live.group import LiveGroup

if TYPE_CHECKING:
    import torch

SIZE_TAG, HEADER_TAG, TENSOR_TAG, DIGEST_TAG = 7301, 7302, 7303, 7304
DIGEST_BYTES = 16  # xxh3-128


class StateTransferCorrupt(RuntimeError):
    """The state received does not match the checksum its sender computed."""


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor stood in the state: the joiner allocates it from this and receives into it."""

    dtype: Any
    shape: tuple[int, ...]


def split(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The state as a pickled header (its tensors replaced by slots) and its tensors, in order."""
    import torch

    tensors: list[torch.Tensor] = []
    buffer = io.BytesIO()
    torch.save(_slot_out(state, tensors), buffer)
    return buffer.getvalue(), tensors


def read_header(header: bytes) -> Any:
    """The header's structure, built by the weights-only unpickler (TensorSlot the one class of ours it may make)."""
    import torch

    with torch.serialization.safe_globals([TensorSlot]):
        return torch.load(io.BytesIO(header), weights_only=True)


def _slot_out(value: Any, tensors: list[torch.Tensor]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().cpu().contiguous())
        return TensorSlot(value.dtype, tuple(value.shape))
    if isinstance(value, dict):  # OrderedDict too: a state dict's order is its meaning
        return type(value)((k, _slot_out(v, tensors)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_slot_out(v, tensors) for v in value)
    return value


def _slot_in(value: Any, received: Any) -> Any:
    if isinstance(value, TensorSlot):
        return next(received)
    if isinstance(value, dict):
        return type(value)((k, _slot_in(v, received)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_slot_in(v, received) for v in value)
    return value


def _slots(value: Any) -> list[TensorSlot]:
    """The slots of a header's structure, in the order `_slot_out` filled them."""
    if isinstance(value, TensorSlot):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _slots(v)]
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return [s for v in value for s in _slots(v)]
    return []


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as uint8, shared (what is sent and hashed)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def digest(header: bytes, tensors: list[torch.Tensor]) -> bytes:
    hasher = new_hasher(ALGORITHM)
    hasher.update(header)
    for t in tensors:
        hasher.update(memoryview(as_bytes(t).numpy()))
    return bytes.fromhex(hasher.hexdigest())


def join(header: bytes, tensors: list[torch.Tensor], expected: bytes) -> Any:
    got = digest(header, tensors)
    if got != expected:
        size = len(header) + sum(t.numel() * t.element_size() for t in tensors)
        raise StateTransferCorrupt(f"state of {size} bytes has checksum {got.hex()} ({ALGORITHM}), its sender's "
                                   f"was {expected.hex()}: the transfer is void; take it again")
    return _slot_in(read_header(header), iter(tensors))


def send_state(group: LiveGroup, state: Any, to_rank: int) -> int:
    """Returns the bytes sent."""
    import torch

    header, tensors = split(state)
    group.send(torch.tensor([len(header)], dtype=torch.int64), to_rank, SIZE_TAG)
    group.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), to_rank, HEADER_TAG)
    for t in tensors:
        if t.numel():
            group.send(as_bytes(t), to_rank, TENSOR_TAG)
    group.send(torch.frombuffer(bytearray(digest(header, tensors)), dtype=torch.uint8), to_rank, DIGEST_TAG)
    return len(header) + sum(t.numel() * t.element_size() for t in tensors)


def receive_state(group: LiveGroup, from_rank: int) -> tuple[Any, int]:
    """The state and its size in bytes."""
    import torch

    size = torch.zeros(1, dtype=torch.int64)
    group.recv(size, from_rank, SIZE_TAG)
    header_t = torch.empty(int(size.item()), dtype=torch.uint8)
    group.recv(header_t, from_rank, HEADER_TAG)
    header = header_t.numpy().tobytes()
    tensors = [torch.empty(s.shape, dtype=s.dtype) for s in _slots(read_header(header))]
    fault_point("live.receive_state.after_header")  # the sender is still sending: the recovery widens
    for t in tensors:
        if t.numel():
            group.recv(as_bytes(t), from_rank, TENSOR_TAG)
    expected = torch.empty(DIGEST_BYTES, dtype=torch.uint8)
    group.recv(expected, from_rank, DIGEST_TAG)
    state = join(header, tensors, expected.numpy().tobytes())
    return state, len(header) + sum(t.numel() * t.element_size() for t in tensors)
