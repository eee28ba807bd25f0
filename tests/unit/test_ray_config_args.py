"""The Ray Train configuration arguments outlast added: what it takes, and what it refuses with the way instead."""

import pytest

from outlast.train import ScalingConfig
from outlast.train.config import CheckpointConfig, RunConfig
from outlast.train.torch import TorchConfig
from outlast.train.trainer import DataParallelTrainer


def test_accelerator_type_asks_a_sliver_of_rays_resource_name():
    trainer = DataParallelTrainer(print, scaling_config=ScalingConfig(num_workers=2, accelerator_type="A100"))
    assert trainer._per_worker() == {"accelerator_type:A100": 0.001}
    with pytest.raises(ValueError, match="accelerator_type"):
        ScalingConfig(accelerator_type="")


def test_label_selector_is_refused_naming_resources_as_the_way():
    with pytest.raises(ValueError, match=r"outlast start --resources NAME=N"):
        ScalingConfig(label_selector={"zone": "a"})
    assert ScalingConfig(label_selector=None).label_selector is None


def test_run_config_takes_env_vars_and_refuses_the_rest_of_a_runtime_env():
    assert RunConfig(worker_runtime_env={"env_vars": {"A": "1"}}).worker_runtime_env == {"env_vars": {"A": "1"}}
    with pytest.raises(ValueError, match=r"does not support: 'pip', 'working_dir'.*packages installed on their node"):
        RunConfig(worker_runtime_env={"pip": ["x"], "working_dir": "."})
    with pytest.raises(TypeError, match=r"\['A'\] must be a string"):
        RunConfig(worker_runtime_env={"env_vars": {"A": 1}})


def test_callbacks_and_storage_filesystem_are_refused_with_the_outlast_way():
    assert RunConfig(callbacks=[]).callbacks == []
    with pytest.raises(ValueError, match="Result.metrics_dataframe"):
        RunConfig(callbacks=[object()])
    with pytest.raises(ValueError, match="storage_path as a URL"):
        RunConfig(storage_filesystem=object())


def test_duplicate_files_is_one_of_two_policies():
    assert CheckpointConfig().duplicate_files == "keep_rank0"
    assert CheckpointConfig(duplicate_files="keep_one").duplicate_files == "keep_rank0"  # its former name
    with pytest.raises(ValueError, match=r"'keep_rank0' \(rank 0's copy\) or 'fail'"):
        CheckpointConfig(duplicate_files="rank0")


def test_torch_init_method_is_env_or_tcp():
    assert TorchConfig(init_method="tcp").init_method == "tcp"
    with pytest.raises(ValueError, match="'env' or 'tcp'"):
        TorchConfig(init_method="file")


def test_trainer_arguments_ray_deprecated_or_outlast_lacks_say_what_to_do():
    with pytest.raises(ValueError, match="same RunConfig"):
        DataParallelTrainer(print, resume_from_checkpoint=object())
    with pytest.raises(ValueError, match="validate in the train function"):
        DataParallelTrainer(print, validation_config=object())
    with pytest.raises(TypeError, match="Ray Data dataset"):
        DataParallelTrainer(print, datasets={"train": type("Dataset", (), {"__module__": "ray.data.dataset"})()})
