"""Virtual ranks: a step's rows and its gradients are the same at any world size, and a resize goes on where the
run was. The shards are walked in this process, a rank at a time; the gradients are reduced by real gloo process
groups of 1, 2 and 3 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from outlast.train import DataConfig, ScalingConfig, data, positions
from outlast.train.data import VirtualBatches, held_virtual_ranks

ROOT = Path(__file__).resolve().parents[2]
ROWS = 60
V = 6


@pytest.mark.parametrize("virtual", [1, 3, 6, 7])
def test_every_virtual_rank_is_held_by_exactly_one_rank_at_every_world_size(virtual):
    for world in range(1, virtual + 1):
        held = [list(held_virtual_ranks(r, world, virtual)) for r in range(world)]
        assert sum(held, []) == list(range(virtual))
        assert all(held), held  # no rank without one
        assert max(map(len, held)) - min(map(len, held)) <= 1


def _walk(world, epochs, steps=None, saved=None, seed=3):
    """Each rank of `world` in turn: its shard of ROWS rows split into V virtual ranks, walked for `steps` steps
    of `epochs` epochs (all of them: None); returns rank -> [(epoch, virtual rank -> rows)] and the documents."""
    out, docs = {}, {}
    for rank in range(world):
        positions.start((lambda: saved) if saved is not None else None)
        data.install_shards({"train": {"i": np.arange(ROWS)}}, DataConfig(virtual_ranks=V), rank, world)
        shard = data._shards["train"]  # get_dataset_shard's, without a session
        steps_taken, seen = 0, []
        walk = shard.iter_batches(batch_size=2, local_shuffle_buffer_size=ROWS, local_shuffle_seed=seed)
        for epoch in range(epochs):
            for batches in walk:
                assert isinstance(batches, VirtualBatches) and batches.virtual_world == V
                seen.append((epoch, {v: b["i"].tolist() for v, b in zip(batches.virtual_ranks, batches)}))
                steps_taken += 1
                docs[rank] = positions.document(world, rank)  # what a report in the loop's body saves
                if steps is not None and steps_taken == steps:
                    break
            if steps is not None and steps_taken == steps:
                break
        out[rank] = seen
    return out, docs


def _by_step(walked):
    """step -> virtual rank -> rows, merged over the ranks (each virtual rank from the rank that held it)."""
    steps: dict[int, dict[int, list[int]]] = {}
    for seen in walked.values():
        for s, (_, parts) in enumerate(seen):
            for v, rows in parts.items():
                assert v not in steps.setdefault(s, {}), f"virtual rank {v} read twice at step {s}"
                steps[s][v] = rows
    return steps


def test_a_steps_rows_are_the_same_at_every_world_size():
    reference = _by_step(_walk(1, epochs=2)[0])
    assert len(reference) == 2 * ROWS // V // 2 and all(len(parts) == V for parts in reference.values())
    for world in (2, 3, 4, 6):
        assert _by_step(_walk(world, epochs=2)[0]) == reference, world


def test_a_resize_goes_on_at_the_next_step_with_the_same_rows():
    reference = _by_step(_walk(3, epochs=1)[0])
    first, docs = _walk(3, epochs=1, steps=2)
    rest, _ = _walk(2, epochs=1, saved=docs)  # 3 -> 2: each virtual rank goes on where it was
    merged = _by_step(first)
    for s, parts in _by_step(rest).items():
        merged[2 + s] = parts
    assert merged == reference


def test_a_restore_at_an_epochs_last_step_goes_on_at_the_next_epoch_on_every_virtual_rank():
    """Saved after the epoch's last batch, in the loop: the first walk reads the empty rest (every virtual rank's
    walk begins and ends it), the next is the next epoch, as in the run that was not restored."""
    reference = _by_step(_walk(2, epochs=2)[0])
    first, docs = _walk(2, epochs=1, steps=ROWS // V // 2)
    rest, _ = _walk(3, epochs=2, saved=docs)
    assert [epoch for epoch, _ in rest[0]] == [1] * (ROWS // V // 2)  # the loop's second walk: the data's epoch 1
    merged = _by_step(first)
    for s, parts in _by_step(rest).items():
        merged[ROWS // V // 2 + s] = parts
    assert merged == reference


def test_a_resize_three_two_three_reads_every_row_once_an_epoch():
    first, docs = _walk(3, epochs=1, steps=1)
    middle, docs = _walk(2, epochs=1, steps=2, saved=docs)
    last, _ = _walk(3, epochs=1, saved=docs)
    rows = [r for walked in (first, middle, last) for seen in walked.values() for _, parts in seen
            for part in parts.values() for r in part]
    assert sorted(rows) == list(range(ROWS))


def test_a_position_saved_under_another_virtual_world_begins_the_epoch_again(caplog):
    _, docs = _walk(3, epochs=1, steps=2)
    positions.start(lambda: docs)
    data.install_shards({"train": {"i": np.arange(ROWS)}}, DataConfig(virtual_ranks=V // 2), 0, 3)
    walked = [b for b in data._shards["train"].iter_batches(batch_size=2)]
    assert len(walked) == ROWS // (V // 2) // 2  # the whole epoch
    assert "has no saved position of its own" in caplog.text


def test_bad_virtual_ranks_are_refused_saying_what_to_set():
    with pytest.raises(ValueError, match="positive int"):
        DataConfig(virtual_ranks=0)
    with pytest.raises(ValueError, match="at least 4"):
        DataConfig(virtual_ranks=3).check_world(4)
    from outlast.train.torch import TorchTrainer

    with pytest.raises(ValueError, match="at least 4"):
        TorchTrainer(lambda: None, datasets={"train": {"i": np.arange(8)}},
                     scaling_config=ScalingConfig(num_workers=(2, 4)), dataset_config=DataConfig(virtual_ranks=3))


def test_gradients_need_the_steps_virtual_batches():
    torch = pytest.importorskip("torch")
    from outlast.train.torch import virtual_rank_gradients

    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match="virtual_ranks=V"):
        virtual_rank_gradients(model, [torch.ones(1, 2)], lambda b: model(b).sum())


_WORKER = textwrap.dedent("""
    import datetime, json, sys
    import torch, torch.distributed as dist
    from outlast.train.data import VirtualBatches, held_virtual_ranks
    from outlast.train.torch import virtual_rank_gradients

    store_path, rank, world, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn({V}, 3, 5, generator=g, dtype=torch.float64)  # 3 rows for each virtual rank
    y = torch.randn({V}, 3, generator=g, dtype=torch.float64)
    held = tuple(held_virtual_ranks(rank, world, {V}))
    batches = VirtualBatches([(x[v], y[v]) for v in held], held, {V})
    losses = virtual_rank_gradients(model, batches, lambda b: ((model(b[0]).squeeze(1) - b[1]) ** 2).mean())
    assert len(losses) == len(held)
    if rank == 0:
        with open(out, "w") as f:
            json.dump([float(v).hex() for p in model.parameters() for v in p.grad.flatten().tolist()], f)
    dist.destroy_process_group()
""").replace("{V}", str(V))


def _gradients(world, tmp_path):
    out = tmp_path / f"grads-{world}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path / f"store-{world}"), str(r), str(world),
                               str(out)], env=env, cwd=ROOT) for r in range(world)]
    assert [p.wait(timeout=120) for p in procs] == [0] * world
    return json.loads(out.read_text())


@pytest.mark.torch
def test_the_gradients_are_the_same_bits_at_one_three_and_four_ranks(tmp_path):
    one = _gradients(1, tmp_path)
    for world in (3, 4):  # 4 ranks of 6 virtual ones hold 1, 2, 1 and 2
        assert _gradients(world, tmp_path) == one, world
