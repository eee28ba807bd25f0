"""One default for what a node preloads, whichever way the node starts."""

from __future__ import annotations

import importlib.util

from outlast.cli.main import build_parser, _default_preload
from outlast.client.preload import TORCH_MODULES, default_preload, with_default
from outlast.train.backend import Backend
from outlast.train.torch.backend import TorchBackend


def test_the_default_is_torch_and_what_ddp_imports_when_torch_is_installed():
    expected = list(TORCH_MODULES) if importlib.util.find_spec("torch") else []
    assert default_preload({}) == expected
    assert "torch._dynamo" in TORCH_MODULES


def test_the_environment_names_the_default_and_empty_means_nothing():
    assert default_preload({"OUTLAST_PRELOAD": "numpy, json"}) == ["numpy", "json"]
    assert default_preload({"OUTLAST_PRELOAD": ""}) == []


def test_outlast_start_and_an_embedded_node_of_either_trainer_use_the_same_default(monkeypatch):
    monkeypatch.setenv("OUTLAST_PRELOAD", "json,email")
    assert _default_preload() == "json,email"
    assert build_parser().parse_args(["start"]).preload is None  # filled in with the default by main()
    assert with_default(Backend.preload) == ["json", "email"]
    assert with_default(TorchBackend.preload) == ["json", "email", *TORCH_MODULES]
