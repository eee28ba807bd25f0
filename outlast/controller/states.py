"""The controller's states, the data each carries, and its transition table.

The table is the whole state machine: the core turns what happened into an `Event`,
asks `transition()` for the next kind of state, and builds that state with its data.
Anything not in the table is a bug and raises. What a state waits for lives in the
state ("waiting for capacity since t, because X"), not in fields of the attempt that
every tick would have to remember to check.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Union

if TYPE_CHECKING:
    from outlast.controller.preemption import Preemption
    from outlast.errors import TrainingFailedError


class State(enum.Enum):
    INITIALIZING = "initializing"
    PLACING = "placing"  # choosing nodes for the attempt (after a fresh look at the node table)
    WAITING_FOR_CAPACITY = "waiting_for_capacity"  # no node set takes the attempt yet
    SCHEDULING = "scheduling"  # spawned; waiting for every rank to say hello
    RUNNING = "running"
    PREEMPTING = "preempting"  # workers keep running so the loop can save one checkpoint
    SAVED = "saved"  # preempted, its checkpoint committed, but nowhere to move yet: trains on
    FINISHING = "finishing"  # every rank returned; their last messages may still be on the way
    RESTARTING = "restarting"  # the attempt failed or was preempted; waiting for its workers to exit
    FINISHED = "finished"
    ERRORED = "errored"
    ABORTED = "aborted"

    # Set on each member below: asked at every step of the controller, a plain attribute, not a property.
    is_terminal: bool
    has_live_workers: bool


for _state in State:
    _state.is_terminal = _state in (State.FINISHED, State.ERRORED, State.ABORTED)
    _state.has_live_workers = _state in (State.SCHEDULING, State.RUNNING, State.PREEMPTING, State.SAVED)


class Event(enum.Enum):
    STARTED = "started"  # the run is set up and can place its first attempt
    PLACED = "placed"  # every rank has a node; the workers are being spawned
    NO_CAPACITY = "no_capacity"  # the nodes cannot take the attempt now
    WORKERS_STARTED = "workers_started"  # every rank of the attempt said hello
    WORKER_FAILED = "worker_failed"  # a worker died or raised: the attempt is over
    RETRY = "retry"  # the failed attempt is torn down and the policy allows another
    GIVE_UP = "give_up"  # the failed attempt is torn down and the budget is spent
    UNRECOVERABLE = "unrecoverable"  # no attempt can help (the driver lease is lost, no capacity in time)
    ALL_EXITED = "all_exited"  # every rank returned from the train function
    ALL_FINISHED = "all_finished"  # ... and its last messages arrived (or the wait for them is over)
    INTERRUPTED = "interrupted"  # the driver was interrupted (Ctrl+C)
    PREEMPTION_NOTICE = "preemption_notice"  # a node of this run is draining
    SAVED_NOWHERE_TO_GO = "saved_nowhere_to_go"  # the preemption's checkpoint is committed; no room elsewhere
    PREEMPTION_SAFE = "preemption_safe"  # restart now: saved with room elsewhere, or time is up


_S, _E = State, Event

TRANSITIONS: dict[tuple[State, Event], State] = {
    (_S.INITIALIZING, _E.STARTED): _S.PLACING,
    (_S.PLACING, _E.PLACED): _S.SCHEDULING,
    (_S.PLACING, _E.NO_CAPACITY): _S.WAITING_FOR_CAPACITY,
    (_S.WAITING_FOR_CAPACITY, _E.PLACED): _S.SCHEDULING,
    (_S.SCHEDULING, _E.WORKERS_STARTED): _S.RUNNING,
    (_S.SCHEDULING, _E.PREEMPTION_NOTICE): _S.PREEMPTING,
    (_S.RUNNING, _E.PREEMPTION_NOTICE): _S.PREEMPTING,
    (_S.PREEMPTING, _E.SAVED_NOWHERE_TO_GO): _S.SAVED,
    (_S.PREEMPTING, _E.PREEMPTION_SAFE): _S.RESTARTING,
    (_S.SAVED, _E.PREEMPTION_SAFE): _S.RESTARTING,
    (_S.RESTARTING, _E.RETRY): _S.PLACING,
    (_S.RESTARTING, _E.GIVE_UP): _S.ERRORED,
    (_S.FINISHING, _E.ALL_FINISHED): _S.FINISHED,
}
for _live in (_S.SCHEDULING, _S.RUNNING, _S.PREEMPTING, _S.SAVED):
    TRANSITIONS[(_live, _E.WORKER_FAILED)] = _S.RESTARTING
    TRANSITIONS[(_live, _E.ALL_EXITED)] = _S.FINISHING
    TRANSITIONS[(_live, _E.ALL_FINISHED)] = _S.FINISHED  # the loop ended during a notice: nothing to resume
for _state in State:
    if not _state.is_terminal:
        TRANSITIONS[(_state, _E.INTERRUPTED)] = _S.ABORTED
        if _state is not _S.INITIALIZING:
            TRANSITIONS[(_state, _E.UNRECOVERABLE)] = _S.ERRORED


class InvalidTransition(RuntimeError):
    pass


def transition(state: State, event: Event) -> State:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(f"no transition from {state.value} on {event.value}") from None


# ---- the states and their data -------------------------------------------------------


@dataclass(frozen=True)
class Initializing:
    kind: ClassVar[State] = State.INITIALIZING


@dataclass(frozen=True)
class Placing:
    kind: ClassVar[State] = State.PLACING
    place_by: float | None  # place on the table as it is by then, even if the head has not answered


@dataclass(frozen=True)
class WaitingForCapacity:
    kind: ClassVar[State] = State.WAITING_FOR_CAPACITY
    since: float
    reason: str
    retry_at: float


@dataclass(frozen=True)
class Scheduling:
    kind: ClassVar[State] = State.SCHEDULING
    since: float  # when the workers were spawned


@dataclass(frozen=True)
class Running:
    kind: ClassVar[State] = State.RUNNING


@dataclass(frozen=True)
class Preempting:
    kind: ClassVar[State] = State.PREEMPTING
    preemption: "Preemption"


@dataclass(frozen=True)
class Saved:
    kind: ClassVar[State] = State.SAVED
    preemption: "Preemption"
    checkpoint: str  # committed after the notice; the next attempt restores it (or a newer one)


@dataclass(frozen=True)
class Finishing:
    kind: ClassVar[State] = State.FINISHING
    since: float  # when the last rank exited


@dataclass(frozen=True)
class Restarting:
    kind: ClassVar[State] = State.RESTARTING
    preemption: "Preemption | None"  # set: the attempt ends for a preemption, charged to its own budget


@dataclass(frozen=True)
class Finished:
    kind: ClassVar[State] = State.FINISHED


@dataclass(frozen=True)
class Errored:
    kind: ClassVar[State] = State.ERRORED
    error: "TrainingFailedError"
    stop_by: float  # workers still alive are waited for until then


@dataclass(frozen=True)
class Aborted:
    kind: ClassVar[State] = State.ABORTED
    stop_by: float


AnyState = Union[Initializing, Placing, WaitingForCapacity, Scheduling, Running, Preempting, Saved, Finishing,
                 Restarting, Finished, Errored, Aborted]
