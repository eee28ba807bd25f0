"""The controller's one seam to the world: what comes in (events), what goes out (effects),
and the worker group that carries effects out and brings events in.

The core (`core.py`) only ever sees these types, so it is stepped the same way by the
loop over real agents (`agent_group.py`) and by the simulator (`outlast/sim/`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union

from outlast.protocol import messages as m

# ---- events in --------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """The run is set up and the node table read once."""


@dataclass(frozen=True)
class Tick:
    """Time passed (timers are checked on every event; a tick is an event with nothing else)."""


@dataclass(frozen=True)
class FromWorker:
    msg: m.WorkerMessage
    incarnation: int = 0  # which process of the rank sent it: a live recovery's replacement counts from 1


@dataclass(frozen=True)
class RefusedFromWorker:
    """A rank sent a message that does not decode (a file path outside its directory, a field of the wrong
    type): it is refused whole, and the rank's attempt fails saying why."""

    attempt: int
    rank: int
    reason: str


@dataclass(frozen=True)
class FromAgent:
    node_id: str
    event: m.AgentEvent


@dataclass(frozen=True)
class NodeTable:
    """The head's answer to `QueryTable`."""

    nodes: list[m.NodeInfo]


@dataclass(frozen=True)
class AgentGone:
    """The agent of a node is known to be gone (the driver's embedded head exited)."""

    node_id: str
    why: str


@dataclass(frozen=True)
class LeaseLost:
    reason: str


@dataclass(frozen=True)
class Interrupted:
    """Ctrl+C in the driver."""


@dataclass(frozen=True)
class LiveJoined:
    """Live recovery: the rank that sent the state to generation `generation`'s new ranks says it went across
    (read from the controller's live store), at `wall`, having thrown `steps_lost` steps away. Generation 0's
    word says in how many `shards` the ranks split the optimizer's state, and whether they train an FSDP2 model
    over `live_mesh` (`mesh`), whose world keeps its shape."""

    attempt: int
    generation: int
    steps_lost: int
    wall: float
    shards: int = 1
    mesh: bool = False


@dataclass(frozen=True)
class LiveReady:
    """Live recovery: `member`, forked for a planned generation, waits in the controller's live store for it."""

    attempt: int
    member: str


InEvent = Union[Started, Tick, FromWorker, RefusedFromWorker, FromAgent, NodeTable, AgentGone, LeaseLost, Interrupted,
                LiveJoined, LiveReady]

# ---- effects out ------------------------------------------------------------------------


@dataclass(frozen=True)
class Spawn:
    node_id: str
    msg: m.SpawnWorkers


@dataclass(frozen=True)
class StopRun:
    """Stop this run's workers of one attempt on one node."""

    node_id: str
    msg: m.StopWorkers


@dataclass(frozen=True)
class ToRank:
    attempt: int
    rank: int
    msg: m.Msg
    watch: bool = False  # to the rank's watch thread (its stacks), not to its loop
    incarnation: int = 0  # which process of the rank: the one whose message was stepped last (`CoreState.reply_to`)


@dataclass(frozen=True)
class ToNode:
    """A message for a node's agent: the run's heartbeat, its end."""

    node_id: str
    msg: m.Msg


@dataclass(frozen=True)
class QueryTable:
    """Ask the head for its node table; the answer comes back as `NodeTable`."""


@dataclass(frozen=True)
class ForgetNode:
    """The node is lost to this run: close its link; it gets no messages any more."""

    node_id: str


@dataclass(frozen=True)
class PublishMembership:
    """Live recovery: publish a generation of attempt `attempt`'s live group in the store the controller holds."""

    attempt: int
    membership: str  # Membership.to_json()


Effect = Union[Spawn, StopRun, ToRank, ToNode, QueryTable, ForgetNode, PublishMembership]


class WorkerGroup(Protocol):
    """Where the run's workers live: carries effects out, brings events in.

    `address` is where workers reach the controller. `refresh` blocks, once; `events` waits at most `timeout_s`
    for something to happen and returns what did (possibly nothing); it never raises for
    a malformed message from outside (it drops it, with a log line).
    """

    address: str

    def refresh(self, timeout_s: float) -> list[m.NodeInfo] | None:
        """The node table, read before the run starts; None if the head does not answer in time."""

    def perform(self, effect: Effect) -> None: ...

    def events(self, timeout_s: float) -> list[InEvent]: ...

    def close(self) -> None: ...
