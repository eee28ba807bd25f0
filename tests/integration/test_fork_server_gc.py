"""A rank starts with the fork server's objects frozen out of the collector (outlast/agent/zygote.py's
`preload`), so that its collections leave the server's pages shared, and with the collector as Python's
defaults otherwise: the server held its full collections off only while it imported."""

from __future__ import annotations

import gc
import json

from outlast.train import RunConfig, ScalingConfig, Trainer


def gc_state_loop(config: dict) -> None:
    import gc
    import json

    with open(config["out"], "w") as f:
        json.dump({"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold(), "enabled": gc.isenabled()}, f)


def test_a_rank_is_forked_with_the_servers_objects_frozen_and_the_collector_as_it_was(storage_path, tmp_path):
    out = tmp_path / "gc.json"
    Trainer(gc_state_loop, train_loop_config={"out": str(out)}, scaling_config=ScalingConfig(num_workers=1),
            run_config=RunConfig(name="fork-server-gc", storage_path=storage_path)).fit()
    state = json.loads(out.read_text())
    # The worker runtime alone, imported by the server before its first fork, is thousands of objects.
    assert state["frozen"] > 1000
    assert state["enabled"] is True
    assert tuple(state["threshold"]) == gc.get_threshold()
