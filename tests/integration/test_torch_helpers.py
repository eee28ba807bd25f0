"""`outlast.train.torch` helpers in real gloo workers."""

from __future__ import annotations

import pytest

from outlast.train import RunConfig, ScalingConfig
from tests.integration.jobs import data_loader_loop, read_events, settled_model_loop


@pytest.mark.torch
def test_prepare_data_loader_gives_each_rank_its_own_shard_and_prepare_model_wraps_in_ddp(storage_path, tmp_path):
    from outlast.train.torch import TorchTrainer

    events = tmp_path / "events.jsonl"
    TorchTrainer(data_loader_loop, train_loop_config={"events": str(events)},
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name="helpers", storage_path=storage_path)).fit()
    by_rank = {e["rank"]: e for e in read_events(events)}
    assert set(by_rank) == {0, 1}
    seen0, seen1 = set(by_rank[0]["seen"]), set(by_rank[1]["seen"])
    assert len(by_rank[0]["seen"]) == len(by_rank[1]["seen"]) == 20
    assert not seen0 & seen1 and seen0 | seen1 == set(range(40))
    assert all(e["device"] == "cpu" and e["wrapped"] == "DistributedDataParallel" for e in by_rank.values())


@pytest.mark.torch
@pytest.mark.parametrize("ddp", [None, {"static_graph": True}], ids=["default", "static_graph"])
def test_prepare_model_lays_out_ddp_buckets_without_running_the_model_or_leaving_gradients(storage_path, tmp_path, ddp):
    from outlast.train.torch import TorchTrainer

    events = tmp_path / "events.jsonl"
    TorchTrainer(settled_model_loop, train_loop_config={"events": str(events), "ddp": ddp},
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name="settled", storage_path=storage_path)).fit()
    seen = [e for e in read_events(events) if e["event"] == "settled"]
    assert len(seen) == 2
    for e in seen:
        assert e["forward_calls"] == 0 and not any(e["grads"]) and e["buffers_unchanged"]
        assert e["forward_calls_after_two_steps"] == 2
