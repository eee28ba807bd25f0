from outlast.cli.runs import render
from outlast.storage.records import RunNote, RunState


def test_a_runs_notes_are_shown_with_its_history():
    state = RunState(name="exp", status="finished", created_at=0.0, updated_at=0.0,
                     notes=[RunNote(text="ranks wrote different contents to 'model.pt' (ranks 0, 1)", time=5.0)])
    shown = render(state, "/runs/exp")
    assert shown.splitlines()[-2] == "notes:"
    assert shown.splitlines()[-1].endswith("ranks wrote different contents to 'model.pt' (ranks 0, 1)")
    assert "notes:" not in render(RunState(name="exp", status="finished", created_at=0.0, updated_at=0.0), "/r")
