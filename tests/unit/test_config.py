import pytest

from outlast.train.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig


def test_defaults_are_valid():
    assert ScalingConfig().num_workers == 1
    assert FailureConfig().max_failures == 0
    assert CheckpointConfig().num_to_keep is None
    assert RunConfig().failure_config == FailureConfig()


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, None])
def test_num_workers_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match=r"ScalingConfig\.num_workers must be an integer >= 1"):
        ScalingConfig(num_workers=value)


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
def test_each_known_placement_strategy_is_accepted(strategy):
    assert ScalingConfig(placement_strategy=strategy).placement_strategy == strategy


@pytest.mark.parametrize("strategy", ["pack", "", "RANDOM"])
def test_an_unknown_placement_strategy_raises_naming_the_field(strategy):
    with pytest.raises(ValueError, match=r"ScalingConfig\.placement_strategy"):
        ScalingConfig(placement_strategy=strategy)


@pytest.mark.parametrize("amount", [-0.5, "1", None])
def test_a_resource_amount_must_be_a_non_negative_number_and_names_its_key(amount):
    with pytest.raises(ValueError, match=r"ScalingConfig\.resources_per_worker\['GPU'\]"):
        ScalingConfig(resources_per_worker={"CPU": 2, "GPU": amount})


def test_zero_and_fractional_resource_amounts_are_accepted():
    assert ScalingConfig(resources_per_worker={"CPU": 0, "GPU": 0.5}).resources_per_worker["GPU"] == 0.5


def test_a_nan_resource_amount_raises():
    with pytest.raises(ValueError, match=r"resources_per_worker\['GPU'\]"):
        ScalingConfig(resources_per_worker={"GPU": float("nan")})


@pytest.mark.parametrize("value", [-1, 0, 5])
def test_max_failures_accepts_minus_one_and_up(value):
    assert FailureConfig(max_failures=value).max_failures == value


@pytest.mark.parametrize("value", [-2, 1.0, False, "3"])
def test_an_invalid_max_failures_raises_naming_the_field(value):
    with pytest.raises(ValueError, match=r"FailureConfig\.max_failures must be an integer >= -1"):
        FailureConfig(max_failures=value)


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_an_invalid_num_to_keep_raises_naming_the_field(value):
    with pytest.raises(ValueError, match=r"CheckpointConfig\.num_to_keep must be an integer >= 1"):
        CheckpointConfig(num_to_keep=value)


@pytest.mark.parametrize("order", ["MAX", "asc", ""])
def test_an_invalid_score_order_raises_naming_the_field(order):
    with pytest.raises(ValueError, match=r"CheckpointConfig\.checkpoint_score_order"):
        CheckpointConfig(checkpoint_score_order=order)


def test_min_score_order_is_accepted():
    assert CheckpointConfig(num_to_keep=1, checkpoint_score_order="min").checkpoint_score_order == "min"


@pytest.mark.parametrize("name", ["", "a/b", 3])
def test_an_invalid_run_name_raises_naming_the_field(name):
    with pytest.raises(ValueError, match=r"RunConfig\(name=.*a name is one directory name .* without '/'"):
        RunConfig(name=name)


def test_none_sub_configs_become_defaults():
    rc = RunConfig(name="exp", failure_config=None, checkpoint_config=None)
    assert (rc.failure_config, rc.checkpoint_config) == (FailureConfig(), CheckpointConfig())
