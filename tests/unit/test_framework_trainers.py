"""The framework trainers' shared shape, the pure parts of the LightGBM integration, and the Transformers callback."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from outlast.train.framework_trainer import SHARED_ARGS


def _trainers():
    from outlast.train.lightgbm import LightGBMTrainer
    from outlast.train.torch import TorchTrainer
    from outlast.train.xgboost import XGBoostTrainer

    return {"torch_config": TorchTrainer, "xgboost_config": XGBoostTrainer, "lightgbm_config": LightGBMTrainer}


@pytest.mark.parametrize("config_arg", ["torch_config", "xgboost_config", "lightgbm_config"])
def test_each_trainer_takes_rays_arguments_in_rays_order(config_arg):
    cls = _trainers()[config_arg]
    names = list(inspect.signature(cls).parameters)
    assert names[:3] == ["train_loop_per_worker", "train_loop_config", config_arg]
    assert tuple(names[3:3 + len(SHARED_ARGS)]) == SHARED_ARGS
    trainer = cls(print, train_loop_config={"lr": 0.1})
    assert trainer.train_fn is print and trainer.train_loop_config == {"lr": 0.1}


@pytest.mark.parametrize("config_arg", ["torch_config", "xgboost_config", "lightgbm_config"])
def test_an_argument_the_trainer_does_not_take_is_refused_naming_the_trainer(config_arg):
    cls = _trainers()[config_arg]
    with pytest.raises(TypeError, match=f"{cls.__name__}\\(\\): got an unexpected keyword argument 'torch_confg'"):
        cls(print, torch_confg=None)
    with pytest.raises(TypeError, match=f"{cls.__name__}\\(\\): too many positional arguments"):
        cls(print, {"lr": 0.1})


def test_a_wrong_type_of_scaling_config_gets_the_trainers_own_error_not_the_backends():
    from outlast.train.torch import TorchTrainer

    with pytest.raises(TypeError, match=r"scaling_config must be a ScalingConfig, got dict: write "
                                        r"scaling_config=ScalingConfig\(\*\*\{'num_workers': 2\}\)"):
        TorchTrainer(print, scaling_config={"num_workers": 2})


@pytest.mark.parametrize("config_arg", ["xgboost_config", "lightgbm_config"])
@pytest.mark.parametrize("legacy", [{"label_column": "y"}, {"params": {}}, {"num_boost_round": 3}])
def test_the_boosting_trainers_legacy_arguments_are_refused_saying_what_to_write(config_arg, legacy):
    cls = _trainers()[config_arg]
    with pytest.raises(DeprecationWarning, match=f"{cls.__name__}.*legacy API.*callbacks=\\[RayTrainReportCallback"):
        cls(print, **legacy)


def test_lightgbm_evaluation_results_nest_by_data_set_and_cross_validation_gives_mean_and_stdv():
    from outlast.train.lightgbm import _eval_results

    env = SimpleNamespace(evaluation_result_list=[("train", "l2", 0.5, False), ("valid", "l2", 0.7, False),
                                                  ("cv_agg", "l1", 0.3, False, 0.01)])
    assert _eval_results(env) == {"train": {"l2": 0.5}, "valid": {"l2": 0.7},
                                  "cv_agg": {"l1-mean": 0.3, "l1-stdv": 0.01}}


@pytest.mark.parametrize("iteration, end, frequency, at_end, saves", [
    (0, 10, 0, True, False), (9, 10, 0, True, True), (9, 10, 0, False, False),
    (2, 10, 3, False, True), (3, 10, 3, False, False), (14, 15, 5, True, True),
])
def test_the_lightgbm_callback_checkpoints_every_frequency_rounds_and_after_the_last(
        iteration, end, frequency, at_end, saves, monkeypatch):
    from outlast import train
    from outlast.train import lightgbm

    reported = []
    monkeypatch.setattr(lightgbm.RayTrainReportCallback, "_save_and_report",
                        lambda self, report, model: reported.append(("checkpoint", report)))
    monkeypatch.setattr(train, "report", lambda report: reported.append(("metrics", report)))
    callback = lightgbm.RayTrainReportCallback(metrics={"loss": "train-l2"}, frequency=frequency,
                                               checkpoint_at_end=at_end)
    callback(SimpleNamespace(iteration=iteration, end_iteration=end, model=None,
                             evaluation_result_list=[("train", "l2", 0.25, False)]))
    assert reported == [("checkpoint" if saves else "metrics", {"loss": 0.25})]


def test_get_network_params_outside_a_lightgbm_trainer_is_empty_and_says_so(caplog):
    from outlast.train.lightgbm import get_network_params

    assert get_network_params() == {}
    assert "outside a LightGBMTrainer's train function" in caplog.text


def test_arrow_backed_columns_become_types_lightgbm_takes_and_others_stay():
    pd = pytest.importorskip("pandas")
    pa = pytest.importorskip("pyarrow")
    from outlast.train.lightgbm import normalize_pandas_for_lightgbm

    df = pd.DataFrame({
        "i": pd.array([1, 2], dtype=pd.ArrowDtype(pa.int32())), "u": pd.array([1, 2], dtype=pd.ArrowDtype(pa.uint8())),
        "f": pd.array([0.5, 1.5], dtype=pd.ArrowDtype(pa.float64())),
        "b": pd.array([True, False], dtype=pd.ArrowDtype(pa.bool_())),
        "s": pd.array(["a", "b"], dtype=pd.ArrowDtype(pa.string())), "n": [1, 2]})
    out = normalize_pandas_for_lightgbm(df)
    assert {c: str(t) for c, t in out.dtypes.items()} == {
        "i": "Int32", "u": "UInt8", "f": "Float64", "b": "boolean", "s": "string[pyarrow]", "n": "int64"}
    assert out["i"].tolist() == [1, 2]


def test_the_transformers_callback_reports_the_checkpoint_of_its_own_step_not_a_newer_one_left_behind(
        tmp_path, monkeypatch):
    # A driver killed after the Trainer saved step 16 and relaunched from step 8's commit saves step 12 next:
    # checkpoint-16 of the killed run is still in output_dir, and is not what step 12 reports.
    pytest.importorskip("transformers")
    from outlast import train
    from outlast.train.huggingface.transformers import RayTrainReportCallback

    for step in (8, 12, 16):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "step").write_text(str(step))
    reported = []

    def report(metrics, checkpoint=None):
        with checkpoint.as_directory() as d:
            reported.append((metrics, (Path(d) / "checkpoint" / "step").read_text()))
    monkeypatch.setattr(train, "report", report)
    state = SimpleNamespace(global_step=12, log_history=[{"loss": 1.0}, {"loss": 0.5, "step": 12}])
    RayTrainReportCallback().on_save(SimpleNamespace(output_dir=str(tmp_path)), state, None)
    assert reported == [({"loss": 0.5, "step": 12}, "12")]
