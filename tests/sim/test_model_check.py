"""check-model (outlast/sim/model_check.py) on the model's own runs: a run the fleet model wrote, replayed, gives back
the parameters it was made with and its own goodput; and a directory without a run is refused with a reason."""

from __future__ import annotations

import pytest

from outlast.sim.fleet import FleetConfig, Mechanisms, simulate
from outlast.sim.interruptions import Effect, Interruption
from outlast.sim.model_check import check, main

CONFIG = FleetConfig(nodes=1, ranks_per_node=4, days=3000 / 86_400, step_s=1.0, checkpoint_every_s=10.0,
                     memory_every_s=10.0, startup_s=30.0, restart_s=5.0, hang_timeout_s=20.0, spares=1, notice_s=60.0,
                     checkpoint_gb_per_rank=1.0, network_gb_s=2.0, storage_gb_s=4.0, host_copy_gb_s=50.0,
                     repair_s=1e9, replace_s=1e9)
# Mid-step, mid-interval: a rank's failure, a hang, a drain that a spare node takes over.
EVENTS = [Interruption(305.5, "a rank fails", Effect.RANK_DIES, 0), Interruption(905.5, "a hang", Effect.HANG, 0),
          Interruption(1404.5, "maintenance", Effect.DRAIN, 0)]


def test_a_model_run_replayed_gives_back_its_parameters_and_its_goodput():
    run = simulate(CONFIG, Mechanisms(memory_tier=True, jit_drain=True, spares=True, elastic=False,
                                   live_recovery=False), EVENTS)
    out = check(run.state, run.reports)
    m = out["measured"]
    assert (m["nodes"], m["ranks_per_node"], m["checkpoint_steps"], m["spares"]) == (1, 4, 10, 1)
    assert m["startup_s"] == pytest.approx(30.0) and m["restart_s"] == pytest.approx(5.0)
    assert m["hang_limit_s"] == pytest.approx(20.0, abs=0.01) and m["commit_s"] == pytest.approx(2.0)
    # The step is measured as the mean report to report, the drain's one just-in-time checkpoint's stall among them.
    assert m["step_s"] == pytest.approx(1.0, abs=0.001)
    assert out["mechanisms"] == "off: elastic, live_recovery"
    assert [e["effect"] for e in out["interruptions"]] == ["rank_dies", "hang", "drain"]
    assert out["real"]["replayed_steps"] > 0 and out["real"]["parts_s"]["drains"] > 0
    assert abs(out["goodput_difference"]) < 0.001, out
    assert max(abs(d) for d in out["parts_difference"].values()) < 0.001, out


def test_a_directory_without_a_run_is_refused_with_what_was_expected(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "nothing")])
    assert e.value.code == 2
    assert "no run history at" in capsys.readouterr().err
