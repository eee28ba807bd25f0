import pytest

from outlast.controller.states import TRANSITIONS, Event, InvalidTransition, State, transition

S, E = State, Event

EXPECTED = {
    (S.INITIALIZING, E.STARTED): S.SCHEDULING,
    (S.SCHEDULING, E.WORKERS_STARTED): S.RUNNING,
    (S.SCHEDULING, E.WORKER_FAILED): S.RESTARTING,
    (S.SCHEDULING, E.ALL_FINISHED): S.FINISHED,
    (S.RUNNING, E.WORKER_FAILED): S.RESTARTING,
    (S.RUNNING, E.ALL_FINISHED): S.FINISHED,
    (S.RESTARTING, E.RETRY): S.SCHEDULING,
    (S.RESTARTING, E.GIVE_UP): S.ERRORED,
    (S.SCHEDULING, E.UNRECOVERABLE): S.ERRORED,
    (S.RUNNING, E.UNRECOVERABLE): S.ERRORED,
    (S.RESTARTING, E.UNRECOVERABLE): S.ERRORED,
    (S.SCHEDULING, E.PREEMPTION_NOTICE): S.PREEMPTING,
    (S.RUNNING, E.PREEMPTION_NOTICE): S.PREEMPTING,
    (S.PREEMPTING, E.PREEMPTION_SAFE): S.RESTARTING,
    (S.PREEMPTING, E.ALL_FINISHED): S.FINISHED,
    (S.PREEMPTING, E.WORKER_FAILED): S.RESTARTING,
    (S.PREEMPTING, E.UNRECOVERABLE): S.ERRORED,
    (S.PREEMPTING, E.INTERRUPTED): S.ABORTED,
    (S.INITIALIZING, E.INTERRUPTED): S.ABORTED,
    (S.SCHEDULING, E.INTERRUPTED): S.ABORTED,
    (S.RUNNING, E.INTERRUPTED): S.ABORTED,
    (S.RESTARTING, E.INTERRUPTED): S.ABORTED,
}
MISSING = [(s, e) for s in State for e in Event if (s, e) not in EXPECTED]


@pytest.mark.parametrize(("state", "event"), list(EXPECTED), ids=lambda x: x.value)
def test_each_row_of_the_table_leads_to_its_next_state(state, event):
    assert transition(state, event) is EXPECTED[(state, event)]


def test_the_table_has_exactly_the_expected_rows():
    assert TRANSITIONS == EXPECTED


@pytest.mark.parametrize(("state", "event"), MISSING, ids=lambda x: x.value)
def test_a_pair_without_a_row_raises_invalid_transition_naming_both(state, event):
    with pytest.raises(InvalidTransition, match=f"from {state.value} on {event.value}"):
        transition(state, event)


@pytest.mark.parametrize("state", [S.FINISHED, S.ERRORED, S.ABORTED])
def test_terminal_states_have_no_way_out(state):
    assert state.is_terminal
    assert not any(s is state for s, _ in TRANSITIONS)


def test_only_scheduling_running_and_preempting_have_live_workers_and_only_three_states_are_terminal():
    assert {s for s in State if s.has_live_workers} == {S.SCHEDULING, S.RUNNING, S.PREEMPTING}
    assert {s for s in State if s.is_terminal} == {S.FINISHED, S.ERRORED, S.ABORTED}


def test_every_non_terminal_state_can_be_interrupted_into_aborted():
    for state in State:
        if not state.is_terminal:
            assert transition(state, E.INTERRUPTED) is S.ABORTED
