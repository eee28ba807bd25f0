"""docs/ray-parity.md is what `python -m outlast.compat.parity` generates from Ray's wheel and outlast."""

from __future__ import annotations

from outlast.compat.parity import DOC, generate
from outlast.compat.ray_api import ray_train_api
from outlast.compat.ray_source import ray_source


def test_the_committed_parity_table_is_up_to_date():
    assert DOC.read_text() == generate(), "docs/ray-parity.md is stale: run `python -m outlast.compat.parity`"


def test_every_public_ray_train_name_is_read_from_the_source_and_listed():
    api = ray_train_api(ray_source())
    assert len(api["ray.train"]) == 32 and len(api["ray.train.torch"]) == 11
    assert not [n.name for names in api.values() for n in names if n.kind == "unknown"]
    text = DOC.read_text()
    for names in api.values():
        for n in names:
            assert f"| `{n.name}` |" in text, n.name
