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


def test_every_module_of_ray_train_a_user_imports_has_its_names_in_the_table():
    from outlast.compat.parity import MODULES

    api = ray_train_api(ray_source(), tuple(MODULES))
    text = DOC.read_text()
    for module, names in api.items():
        section = text.split(f"## `{module}` → ", 1)[1].split("\n## ", 1)[0]
        assert names and all(f"| `{n.name}` |" in section for n in names), module
    assert {n.name for n in api["ray.train.lightning"]} == {
        "prepare_trainer", "RayDDPStrategy", "RayFSDPStrategy", "RayDeepSpeedStrategy", "RayLightningEnvironment",
        "RayTrainReportCallback"}
