"""The store the controller holds for its ranks' live groups (FailureConfig(live_recovery=True)): where each
generation's membership is published, each step voted on, each group formed. It lives in the driver's process,
beside the controller, which is handed it (`Controller(live=...)`): no rank hosts it, so any rank, rank 0
included, dies without taking the rendezvous with it. Effects only; `outlast/controller/live.py` decides."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Callable

from outlast.controller.group import LiveJoined, LiveReady
from outlast.protocol.membership import LATEST, Membership, joined_key, membership_key, ready_key, store_prefix

TIMEOUT_S = 60.0


class LiveStore:
    """`store`: a torch.distributed store (the simulator's in memory, `outlast/sim/live.py`); `scoped(attempt)`
    gives its view under the attempt's prefix, the one the attempt's ranks use."""

    def __init__(self, store: Any, address: str, scoped: Callable[[int], Any]) -> None:
        self.store = store
        self.address = address
        self._scoped = scoped
        self._prefixed: dict[int, Any] = {}

    @classmethod
    def hosted(cls, host: str) -> LiveStore:
        """A TCPStore on `host`, on a port of its own."""
        import torch.distributed as dist

        # In the driver's process, whose threads it joins: the driver forks nothing after this (its agent, when
        # embedded, is started before the controller, and by exec).
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
        return cls(store, f"{host}:{store.port}", lambda attempt: dist.PrefixStore(store_prefix(attempt), store))

    def _of(self, attempt: int) -> Any:
        if attempt not in self._prefixed:
            self._prefixed[attempt] = self._scoped(attempt)
        return self._prefixed[attempt]

    def publish(self, attempt: int, membership_json: str) -> None:
        """The membership first, then the pointer to it: a reader that sees the pointer finds the membership."""
        generation = Membership.from_json(membership_json).generation
        s = self._of(attempt)
        s.set(membership_key(generation), membership_json)
        s.set(LATEST, str(generation))

    def joined(self, attempt: int, generation: int) -> LiveJoined | None:
        s = self._of(attempt)
        if not s.check([joined_key(generation)]):
            return None
        d = json.loads(s.get(joined_key(generation)).decode())
        return LiveJoined(attempt, generation, int(d["steps_lost"]), float(d["wall"]), int(d.get("shards", 1)),
                          bool(d.get("mesh", False)))

    def ready(self, attempt: int, member: str) -> LiveReady | None:
        return LiveReady(attempt, member) if self._of(attempt).check([ready_key(member)]) else None


def host_of(address: str) -> str:
    """The host of a ZeroMQ endpoint ("tcp://10.0.0.5:4242")."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
