"""The tier server's schedule: which thread a request waits for, the transfers in flight and when they
end, and when a replica beside a durable commit may go while the node drains.

Pure: no sockets, no files, no clock. Every method takes the time as an argument and returns what
to do, with its reason; the tier server (`tier_server.py`) carries it out on its threads and
sockets. The budget and the copies held are the store's: `TierBook` (`outlast/storage/memtier.py`,
pure as well) decides them, and `TierStore` carries its decisions out on the node's files.

Times: a transfer's are the server's monotonic clock; a drain's are wall-clock seconds, as the
controller's `NodeDraining.deadline_unix_s` says its deadline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from outlast.protocol import messages as m
from outlast.storage.memtier import CopyKey

DRAIN_HOLD_S = 120.0  # a drain without a deadline holds replicas beside durable commits back this long at most
SWEEP_EVERY_S = 10.0  # transfers are looked over for silence at most this far apart (sooner with a short timeout)

Queue = Literal["upload", "waited", "hold"]
C = TypeVar("C")  # what the server keeps of each transfer (its seal, the files it writes): never read here


def queue_for(msg: m.TierHold | m.TierPull | m.TierUpload) -> Queue:
    """The thread a request waits for: "upload" (storage's time), "waited" (what a commit or a restore waits
    for: a hold with files to copy in, a pull) or "hold" (a replica of a copy held already, beside a durable
    commit)."""
    if isinstance(msg, m.TierUpload):
        return "upload"
    return "waited" if isinstance(msg, m.TierPull) or msg.source_dir else "hold"


# ---- transfers in flight ----------------------------------------------------------------------------------

@dataclass
class OpenTransfer(Generic[C]):
    """A transfer open on the server: an offer being received (its files declared), or a fetch."""

    session: bytes
    key: CopyKey
    used: float  # when a chunk or a fetch of it last came
    sizes: dict[str, int] | None  # an offer's files as declared (no chunk writes past them); None: a fetch
    carrier: C  # the server's own

    @property
    def is_offer(self) -> bool:
        return self.sizes is not None

    def past_declared(self, path: str, offset: int, length: int) -> str | None:
        """Why a chunk of an offer cannot be written: bytes past the size its file was declared with (the budget
        counts the declared sizes). The transfer ends with it."""
        declared = (self.sizes or {}).get(path, 0)
        if offset < 0 or offset + length > declared:
            return (f"a chunk of {path} at {offset} ({length} bytes) goes past its declared {declared} bytes: "
                    "the transfer is refused")
        return None


@dataclass(frozen=True)
class EndTransfer(Generic[C]):
    """A transfer is over without its copy kept: its files are closed, and what an offer wrote goes, with its
    bytes in the budget."""

    transfer: OpenTransfer[C]
    reason: str


class Transfers(Generic[C]):
    """The transfers open on one tier server, each ended by its end, its failure, or `timeout_s` of silence (its
    sender died, or closed its socket: ZeroMQ tells the server neither)."""

    def __init__(self, node_id: str, timeout_s: float) -> None:
        self.node_id = node_id
        self.timeout_s = timeout_s
        self._open: dict[bytes, OpenTransfer[C]] = {}
        # An offer ends (its TierOfferEnd) on the server's CURVE socket, from the sender that made it.
        self._offers: dict[tuple[bytes, CopyKey], bytes] = {}
        self._swept: float | None = None

    def open(self, session: bytes, key: CopyKey, now: float, carrier: C, sender: bytes | None = None,
             sizes: dict[str, int] | None = None) -> OpenTransfer[C]:
        """A fetch (no `sender`), or an offer from `sender` of files of `sizes`."""
        transfer = self._open[session] = OpenTransfer(session, key, now, sizes, carrier)
        if sender is not None:
            self._offers[(sender, key)] = session
        return transfer

    def touch(self, session: bytes, key: CopyKey, now: float) -> OpenTransfer[C] | str:
        """The transfer a chunk or a fetch of `key` belongs to, used at `now`; or why there is none."""
        transfer = self._open.get(session)
        if transfer is None or transfer.key != key:
            return f"no transfer of {key.checkpoint_dir} rank {key.rank} is open on {self.node_id}"
        transfer.used = now
        return transfer

    def offer_of(self, sender: bytes, key: CopyKey) -> bytes | None:
        """The session of the offer `sender` is making of `key`, if one is open."""
        return self._offers.get((sender, key))

    def finish_offer(self, sender: bytes, key: CopyKey) -> OpenTransfer[C] | str:
        """The offer `sender` ends, closed here, its copy to be kept; or why there is none open."""
        transfer = self._open.pop(self._offers.pop((sender, key), b""), None)
        if transfer is None:  # ended (silent past the timeout, or failed), or never offered by this sender
            return (f"no transfer of {key.checkpoint_dir} rank {key.rank} from this sender is open on "
                    f"{self.node_id}: it failed, or was silent for {self.timeout_s:.0f} s")
        return transfer

    def end(self, session: bytes | None) -> OpenTransfer[C] | None:
        """The transfer ended without its copy kept (its failure, or its run freed): what to let go."""
        for offer in [o for o, s in self._offers.items() if s == session]:
            del self._offers[offer]
        return self._open.pop(session, None) if session is not None else None

    def of_run(self, run: str) -> list[bytes]:
        return [s for s, t in self._open.items() if t.key.run == run]

    def receiving(self, key: CopyKey) -> bool:
        """An offer of `key` is being received here."""
        return any(t.key == key and t.is_offer for t in self._open.values())

    def all(self) -> list[OpenTransfer[C]]:
        return list(self._open.values())

    def sweep(self, now: float) -> list[EndTransfer[C]]:
        """The transfers silent past the timeout, ended; looked over at most every `SWEEP_EVERY_S` (a quarter of
        the timeout when that is shorter)."""
        if self._swept is None:
            self._swept = now
        if now - self._swept <= min(SWEEP_EVERY_S, self.timeout_s / 4):
            return []
        self._swept = now
        ended: list[EndTransfer[C]] = []
        for transfer in [t for t in self._open.values() if now - t.used > self.timeout_s]:
            self.end(transfer.session)
            key, silent = transfer.key, now - transfer.used
            ended.append(EndTransfer(transfer, f"a replica of {key.checkpoint_dir} rank {key.rank} being received on "
                                               f"{self.node_id} has been silent for {silent:.0f} s: its sender died or "
                                               "gave up; what came of it is dropped" if transfer.is_offer else
                                               f"a fetch of {key.checkpoint_dir} rank {key.rank} from {self.node_id} "
                                               f"has been silent for {silent:.0f} s: its asker died or gave up"))
        return ended


# ---- replicas held back while the node drains ----------------------------------------------------------------

@dataclass(frozen=True)
class Gate:
    """Whether a replica beside a durable commit may go on now; if not, how long until it is asked again."""

    go: bool
    wait_s: float
    reason: str


class ReplicaGate:
    """While the node drains, its cores and its bandwidth go to the checkpoint saved for the drain: replicas
    beside durable commits (in storage already) wait until what the drain's commit waits for has been held here
    and on its peer, or until the drain's deadline (`DRAIN_HOLD_S` after the drain without one). Seen: a 2 GB
    replica of the checkpoint before still going while a drain's checkpoint was saved."""

    def __init__(self) -> None:
        self.until: float | None = None  # None: replicas go
        self.waited_busy = 0  # requests in the "waited" queue or being carried out
        self.waited_done = False  # one of them ended since the drain began

    def drain(self, deadline_unix_s: float | None, now: float) -> None:
        self.until = deadline_unix_s if deadline_unix_s is not None else now + DRAIN_HOLD_S
        self.waited_done = False

    def waited_began(self) -> None:
        self.waited_busy += 1

    def waited_ended(self) -> None:
        self.waited_busy -= 1
        self.waited_done = True

    def may_go(self, now: float) -> Gate:
        if self.until is None:
            return Gate(True, 0.0, "the node is not draining")
        left = self.until - now
        if left <= 0:
            self.until = None
            return Gate(True, 0.0, "the drain's hold on replicas reached its deadline")
        if self.waited_done and not self.waited_busy:
            self.until = None
            return Gate(True, 0.0, "what the drain's commit waits for has been held")
        return Gate(False, left, f"the node drains: replicas beside durable commits wait {left:.1f} s at most "
                                 "for the drain's checkpoint to be held")
