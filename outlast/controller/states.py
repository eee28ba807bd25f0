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
    FINISHED = "finished"
    ERRORED = "errored"
    ABORTED = "aborted"

    @property
    def is_terminal(self) -> bool:
        return self in (State.FINISHED, State.ERRORED, State.ABORTED)

    @property
    def has_live_workers(self) -> bool:
        return self in (State.SCHEDULING, State.RUNNING)


class Event(enum.Enum):
    STARTED = "started"  # the run is set up and can place its first attempt
    WORKERS_STARTED = "workers_started"  # every rank of the attempt said hello
    FAILURE_RETRY = "failure_retry"  # a worker failed and the policy allows another attempt
    FAILURE_FATAL = "failure_fatal"  # a worker failed and the budget is spent
    TEARDOWN_DONE = "teardown_done"  # every worker of the failed attempt has exited
    ALL_FINISHED = "all_finished"  # every rank returned from the train function
    INTERRUPTED = "interrupted"  # the driver was interrupted (Ctrl+C)


_S, _E = State, Event

TRANSITIONS: dict[tuple[State, Event], State] = {
    (_S.INITIALIZING, _E.STARTED): _S.SCHEDULING,
    (_S.SCHEDULING, _E.WORKERS_STARTED): _S.RUNNING,
    (_S.SCHEDULING, _E.FAILURE_RETRY): _S.RESTARTING,
    (_S.SCHEDULING, _E.FAILURE_FATAL): _S.ERRORED,
    (_S.SCHEDULING, _E.ALL_FINISHED): _S.FINISHED,
    (_S.RUNNING, _E.FAILURE_RETRY): _S.RESTARTING,
    (_S.RUNNING, _E.FAILURE_FATAL): _S.ERRORED,
    (_S.RUNNING, _E.ALL_FINISHED): _S.FINISHED,
    (_S.RESTARTING, _E.TEARDOWN_DONE): _S.SCHEDULING,
    (_S.RESTARTING, _E.FAILURE_FATAL): _S.ERRORED,
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
