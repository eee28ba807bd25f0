import pytest

from outlast.controller.states import TRANSITIONS, Event, InvalidTransition, State, transition

S, E = State, Event

LIVE = (S.SCHEDULING, S.RUNNING, S.PREEMPTING, S.SAVED)
EXPECTED = {
    (S.INITIALIZING, E.STARTED): S.PLACING,
    (S.PLACING, E.PLACED): S.SCHEDULING,
    (S.PLACING, E.NO_CAPACITY): S.WAITING_FOR_CAPACITY,
    (S.WAITING_FOR_CAPACITY, E.PLACED): S.SCHEDULING,
    (S.SCHEDULING, E.WORKERS_STARTED): S.RUNNING,
    (S.SCHEDULING, E.PREEMPTION_NOTICE): S.PREEMPTING,
    (S.RUNNING, E.PREEMPTION_NOTICE): S.PREEMPTING,
    (S.PREEMPTING, E.SAVED_NOWHERE_TO_GO): S.SAVED,
    (S.PREEMPTING, E.PREEMPTION_SAFE): S.RESTARTING,
    (S.SAVED, E.PREEMPTION_SAFE): S.RESTARTING,
    (S.RESTARTING, E.RETRY): S.PLACING,
    (S.RESTARTING, E.GIVE_UP): S.ERRORED,
    (S.FINISHING, E.ALL_FINISHED): S.FINISHED,
    **{(s, E.WORKER_FAILED): S.RESTARTING for s in LIVE},
    **{(s, E.ALL_EXITED): S.FINISHING for s in LIVE},
    **{(s, E.ALL_FINISHED): S.FINISHED for s in LIVE},
    **{(s, E.INTERRUPTED): S.ABORTED for s in State if not s.is_terminal},
    **{(s, E.UNRECOVERABLE): S.ERRORED for s in State if not s.is_terminal and s is not S.INITIALIZING},
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


def test_only_states_with_spawned_workers_have_live_workers_and_only_three_states_are_terminal():
    assert {s for s in State if s.has_live_workers} == set(LIVE)
    assert {s for s in State if s.is_terminal} == {S.FINISHED, S.ERRORED, S.ABORTED}


def test_finishing_and_restarting_wait_for_messages_not_for_workers_so_no_deadline_applies_there():
    # Issue 8 (b): a preemption deadline in a state without live workers has nothing to act on.
    assert (S.FINISHING, E.PREEMPTION_SAFE) not in TRANSITIONS
    assert (S.RESTARTING, E.ALL_FINISHED) not in TRANSITIONS
