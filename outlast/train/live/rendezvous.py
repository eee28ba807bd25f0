"""Memberships in the store the controller holds: the controller publishes, members wait and read.

No rank hosts this store, so losing any rank loses no rendezvous. A membership names its store
only through the caller: a controller that moves hands its members the new address, and they
connect to it (`connect`).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING

from outlast.protocol.membership import LATEST, Membership, membership_key, ready_key

if TYPE_CHECKING:
    from torch.distributed import Store

class NotAMemberError(RuntimeError):
    """This process is in no newer generation: the group went on without it (it should exit)."""


def connect(host: str, port: int, timeout_s: float) -> Store:
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def publish(store: Store, membership: Membership) -> None:
    """The membership first, then the pointer to it: a reader that sees the pointer finds the membership."""
    store.set(membership_key(membership.generation), membership.to_json())
    store.set(LATEST, str(membership.generation))


def newer_published(store: Store, generation: int) -> bool:
    return store.check([membership_key(generation + 1)])


def newest_after(store: Store, generation: int) -> Membership | None:
    """The newest generation published after `generation`, if any."""
    if not newer_published(store, generation):
        return None
    latest = max(int(store.get(LATEST)) if store.check([LATEST]) else generation + 1, generation + 1)
    return Membership.from_json(store.get(membership_key(latest)).decode())


def await_membership(store: Store, member: str, after: int, timeout_s: float, spare: bool,
                     poll_s: float = 0.002) -> Membership:
    """The newest generation after `after` that names `member` (`look_for_membership`), waited for."""
    deadline = time.monotonic() + timeout_s
    if spare:
        say_ready(store, member)
    while True:
        membership, after = look_for_membership(store, member, after, spare)
        if membership is not None:
            return membership
        if time.monotonic() > deadline:
            raise TimeoutError(f"member {member}: no generation after {after} named it within {timeout_s} s")
        time.sleep(poll_s)


def say_ready(store: Store, member: str) -> None:
    """A member that has held no rank yet waits: the controller publishes a planned generation that names it once
    it reads this (`LiveStore.ready`)."""
    store.set(ready_key(member), "1")


def look_for_membership(store: Store, member: str, after: int, spare: bool) -> tuple[Membership | None, int]:
    """One look for the newest generation after `after` that names `member`, and the generation to look after
    next time. Generations published while this member was busy are skipped: only the newest can still form. A
    `spare` (a member that has held no rank yet) waits through generations that do not name it; a member that
    held a rank and is left out of the newest generation raises NotAMemberError."""
    if not store.check([membership_key(after + 1)]):
        return None, after
    latest = max(int(store.get(LATEST)) if store.check([LATEST]) else after + 1, after + 1)
    membership = Membership.from_json(store.get(membership_key(latest)).decode())
    if membership.rank_of(member) is not None:
        return membership, after
    if not spare:
        raise NotAMemberError(f"member {member} is not in generation {membership.generation} "
                              f"(members {list(membership.members)})")
    return None, latest
