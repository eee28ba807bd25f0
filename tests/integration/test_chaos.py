"""Many random faults, and the weights still end bit for bit where a run without faults ends."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from outlast.train import FailureConfig, RunConfig, ScalingConfig
from tests.integration.jobs import deterministic_ddp_loop, read_events


def _train(storage_path, tmp_path, name, faults, workers=2, every=3):
    from outlast.train.torch import TorchTrainer

    events = tmp_path / f"{name}.jsonl"
    result = TorchTrainer(
        deterministic_ddp_loop,
        train_loop_config={"events": str(events), "steps": 40, "every": every, "faults": faults},
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(name=name, storage_path=storage_path, failure_config=FailureConfig(max_failures=-1)),
    ).fit()
    digests = [e["digest"] for e in read_events(events) if e["event"] == "weights"]
    return result, digests


@pytest.mark.torch
def test_a_run_with_random_faults_ends_with_the_same_weights_as_one_without(storage_path, tmp_path):
    rng = random.Random(20261129)
    # Attempts 1 to 6 each fail a random number of steps after their start (on either rank: a
    # SIGKILL of the worker, an exception, a SIGKILL of its fork server or of the node agent the
    # driver started), often between two checkpoints, so that steps are redone after a restore.
    faults = [[attempt, rng.randrange(2), rng.randrange(1, 7), rng.choice(["kill", "raise", "forkserver", "agent"])]
              for attempt in range(1, 7)]
    assert {f[3] for f in faults} == {"kill", "raise", "forkserver", "agent"}  # this seed draws every kind
    _, clean = _train(storage_path, tmp_path, "clean", [])
    result, chaotic = _train(storage_path, tmp_path, "chaos", faults)
    assert len(clean) == 1 and chaotic == clean
    assert result.last_metrics == {"step": 39}
    state = json.loads((Path(storage_path) / "chaos" / "run_state.json").read_text())
    assert state["failure_counts"]["worker"] == 6 and len(state["attempts"]) == 7


@pytest.mark.torch
def test_three_ranks_restored_after_a_sigkill_end_with_the_weights_of_the_run_without_it(storage_path, tmp_path):
    # From 3 ranks on an allreduce's sums depend on each element's place in its gradient bucket, and DDP's first
    # iteration used another layout than the later ones: the first step after the restore differed in its last bits
    # from the step the run without the kill took (docs/guide/failures.md, "Bit for bit").
    _, clean = _train(storage_path, tmp_path, "clean", [], workers=3, every=5)
    # Rank 1 dies 22 steps in; the run goes on from the checkpoint of step 19 in new processes.
    result, killed = _train(storage_path, tmp_path, "killed", [[1, 1, 22, "kill"]], workers=3, every=5)
    assert len(clean) == 1 and killed == clean
    assert result.last_metrics == {"step": 39}
    state = json.loads((Path(storage_path) / "killed" / "run_state.json").read_text())
    assert state["failure_counts"]["worker"] == 1 and len(state["attempts"]) == 2
