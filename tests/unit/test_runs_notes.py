from outlast.cli.runs import render
from outlast.storage.records import RunNote, RunState


def test_a_runs_notes_are_shown_with_its_history():
    state = RunState(name="exp", status="finished", created_at=0.0, updated_at=0.0,
                     notes=[RunNote(text="ranks wrote different contents to 'model.pt' (ranks 0, 1)", time=5.0)])
    shown = render(state, "/runs/exp")
    assert shown.splitlines()[-2] == "notes:"
    assert shown.splitlines()[-1].endswith("ranks wrote different contents to 'model.pt' (ranks 0, 1)")
    assert "notes:" not in render(RunState(name="exp", status="finished", created_at=0.0, updated_at=0.0), "/r")


def test_a_runs_live_recoveries_are_shown_with_the_path_each_took():
    from outlast.storage.records import LiveRecoveryRecord

    state = RunState(name="exp", status="finished", created_at=0.0, updated_at=0.0, live_recoveries=[
        LiveRecoveryRecord(attempt=1, ranks=[1], cause="rank 1 was killed by SIGKILL", path="live", time=5.0,
                           generation=1, steps_lost=1, seconds=0.21),
        LiveRecoveryRecord(attempt=1, ranks=[0], cause="rank 0 was killed by SIGKILL", path="restart", time=9.0,
                           reason="no rank that holds the state is left")])
    lines = render(state, "/runs/exp").splitlines()
    at = lines.index("live recoveries (each charged to max_failures):")
    assert lines[at + 1].endswith("rank 1 was killed by SIGKILL; live: rank(s) [1] replaced, the state taken from "
                                  "the others in 0.21 s, 1 step(s) lost")
    assert lines[at + 2].endswith("restart from the newest checkpoint: no rank that holds the state is left")
