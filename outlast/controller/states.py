"""The controller's states and its transition table.

The table is the whole state machine: the runtime turns what happened into an
`Event`, asks `transition()` for the next state, and performs the effects of
entering it. Anything not in the table is a bug and raises.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    INITIALIZING = "initializing"
    SCHEDULING = "scheduling"
    RUNNING = "running"
    RESTARTING = "restarting"
    PREEMPTING = "preempting"  # workers keep running so the loop can save one checkpoint
    FINISHED = "finished"
    ERRORED = "errored"
    ABORTED = "aborted"

    @property
    def is_terminal(self) -> bool:
        return self in (State.FINISHED, State.ERRORED, State.ABORTED)

    @property
    def has_live_workers(self) -> bool:
        return self in (State.SCHEDULING, State.RUNNING, State.PREEMPTING)


class Event(enum.Enum):
    STARTED = "started"  # the run is set up and can place its first attempt
    WORKERS_STARTED = "workers_started"  # every rank of the attempt said hello
    WORKER_FAILED = "worker_failed"  # a worker died or raised: the attempt is over
    RETRY = "retry"  # the failed attempt is torn down and the policy allows another
    GIVE_UP = "give_up"  # the failed attempt is torn down and the budget is spent
    UNRECOVERABLE = "unrecoverable"  # no attempt can help (the node agent or the driver lease is lost)
    ALL_FINISHED = "all_finished"  # every rank returned from the train function
    INTERRUPTED = "interrupted"  # the driver was interrupted (Ctrl+C)
    PREEMPTION_NOTICE = "preemption_notice"  # a node of this run is draining
    PREEMPTION_SAFE = "preemption_safe"  # a checkpoint after the notice is committed, or time is up


_S, _E = State, Event

TRANSITIONS: dict[tuple[State, Event], State] = {
    (_S.INITIALIZING, _E.STARTED): _S.SCHEDULING,
    (_S.SCHEDULING, _E.WORKERS_STARTED): _S.RUNNING,
    (_S.SCHEDULING, _E.WORKER_FAILED): _S.RESTARTING,
    (_S.SCHEDULING, _E.ALL_FINISHED): _S.FINISHED,
    (_S.RUNNING, _E.WORKER_FAILED): _S.RESTARTING,
    (_S.RUNNING, _E.ALL_FINISHED): _S.FINISHED,
    (_S.RESTARTING, _E.RETRY): _S.SCHEDULING,
    (_S.RESTARTING, _E.GIVE_UP): _S.ERRORED,
    (_S.SCHEDULING, _E.UNRECOVERABLE): _S.ERRORED,
    (_S.RUNNING, _E.UNRECOVERABLE): _S.ERRORED,
    (_S.RESTARTING, _E.UNRECOVERABLE): _S.ERRORED,
    (_S.SCHEDULING, _E.PREEMPTION_NOTICE): _S.PREEMPTING,
    (_S.RUNNING, _E.PREEMPTION_NOTICE): _S.PREEMPTING,
    (_S.PREEMPTING, _E.PREEMPTION_SAFE): _S.RESTARTING,
    (_S.PREEMPTING, _E.ALL_FINISHED): _S.FINISHED,  # the loop ended during the notice: nothing to resume
    (_S.PREEMPTING, _E.WORKER_FAILED): _S.RESTARTING,
    (_S.PREEMPTING, _E.UNRECOVERABLE): _S.ERRORED,
    (_S.PREEMPTING, _E.INTERRUPTED): _S.ABORTED,
    (_S.INITIALIZING, _E.INTERRUPTED): _S.ABORTED,
    (_S.SCHEDULING, _E.INTERRUPTED): _S.ABORTED,
    (_S.RUNNING, _E.INTERRUPTED): _S.ABORTED,
    (_S.RESTARTING, _E.INTERRUPTED): _S.ABORTED,
}


class InvalidTransition(RuntimeError):
    pass


def transition(state: State, event: Event) -> State:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(f"no transition from {state.value} on {event.value}") from None
