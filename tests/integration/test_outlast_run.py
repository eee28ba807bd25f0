"""The `ray` alias of `outlast run`, each case in a fresh interpreter (the alias is per process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).parents[2]


def run_script(tmp_path: Path, body: str, *, through_outlast: bool = True) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    cmd = [sys.executable, "-m", "outlast.cli.main", "run", str(script)] if through_outlast \
        else [sys.executable, str(script)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ray_train_names_are_outlasts_and_init_shutdown_are_accepted(tmp_path):
    proc = run_script(tmp_path, """
        import outlast.train, outlast.train.torch
        import ray
        import ray.train
        import ray.train.torch
        from ray import train
        from ray.train import torch as ray_torch
        assert train.report is outlast.train.report and ray_torch.prepare_model is outlast.train.torch.prepare_model
        from ray.train import Checkpoint, ScalingConfig
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
        from ray.train.v2.torch.torch_trainer import TorchTrainer
        import outlast.train, outlast.train.torch
        ray.init(num_cpus=3, address="auto")
        assert ray.is_initialized()
        assert ray.train.report is outlast.train.report and Checkpoint is outlast.train.Checkpoint
        assert DataParallelTrainer is outlast.train.DataParallelTrainer
        assert TorchTrainer is ray.train.torch.TorchTrainer is outlast.train.torch.TorchTrainer
        assert ScalingConfig is outlast.train.ScalingConfig
        assert not hasattr(outlast.train, "v2")  # outlast's own modules are left as they are
        ray.shutdown()
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_any_other_ray_api_stops_at_once_naming_the_call_and_line_past_except_exception(tmp_path):
    proc = run_script(tmp_path, """
        import ray
        try:
            @ray.remote
            def f():
                pass
        except Exception:
            print("swallowed")
        print("went on")
    """)
    assert proc.returncode == 2 and "swallowed" not in proc.stdout and "went on" not in proc.stdout
    assert f"outlast run: ray.remote at {tmp_path / 'script.py'}, line 4 is not supported" in proc.stderr


def test_importing_another_ray_module_stops_at_its_import_line(tmp_path):
    proc = run_script(tmp_path, """
        import ray.train

        import ray.tune
    """)
    assert proc.returncode == 2
    assert f"import ray.tune at {tmp_path / 'script.py'}, line 4 is not supported" in proc.stderr
    proc = run_script(tmp_path, "from ray import tune\n")
    assert proc.returncode == 2 and "line 1 is not supported" in proc.stderr


def test_a_ray_train_name_outlast_lacks_stops_with_the_outlast_way(tmp_path):
    proc = run_script(tmp_path, "from ray.train import SyncConfig\n")
    assert proc.returncode == 2
    assert "ray.train.SyncConfig at" in proc.stderr and "storage_path" in proc.stderr


def test_ray_data_runs_its_transforms_and_stops_at_a_name_outlast_lacks(tmp_path):
    proc = run_script(tmp_path, """
        import ray.data
        ds = ray.data.from_items([{"x": 1}, {"x": 2}]).map_batches(lambda b: {"x": b["x"] * 10})
        assert [r["x"] for r in ds.take_all()] == [10, 20]
        ray.data.read_sql("select 1", None)
    """)
    assert proc.returncode == 2
    assert "ray.data.read_sql at" in proc.stderr and "line 5" in proc.stderr and "read_parquet" in proc.stderr
    proc = run_script(tmp_path, """
        import ray.data
        ray.data.from_items([{"x": 1}]).groupby("x")
    """)
    assert proc.returncode != 0 and "Dataset.groupby is not supported by outlast" in proc.stderr


def test_a_process_outside_outlast_run_sees_no_alias(tmp_path):
    proc = run_script(tmp_path, """
        import importlib.util, sys
        import outlast.train, outlast.train.torch, outlast.compat.ray_alias, outlast.cli.main
        assert not any(type(f).__name__ == "RayAliasFinder" for f in sys.meta_path)
        spec = importlib.util.find_spec("ray")
        assert spec is None or "site-packages" in (spec.origin or ""), spec
        print("ok")
    """, through_outlast=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_ray_docs_style_script_with_ray_data_items_trains_on_its_shards(tmp_path):
    storage = tmp_path / "storage"
    proc = run_script(tmp_path, f"""
        import ray
        import ray.data
        import ray.train
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        def train_fn(config):
            shard = ray.train.get_dataset_shard("train")
            xs = [int(x) for batch in shard.iter_torch_batches(batch_size=2) for x in batch["x"]]
            ray.train.report({{"xs": xs, "rank": ray.train.get_context().get_world_rank()}})
            return xs

        ray.init()
        result = TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=2),
                              datasets={{"train": ray.data.from_items([{{"x": i}} for i in range(6)])}},
                              run_config=RunConfig(name="docs", storage_path={str(storage)!r})).fit()
        print("returned", result.return_value)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "returned [0, 1, 2]" in proc.stdout


def test_a_ray_script_reading_csv_with_ray_data_trains_on_two_ranks(tmp_path):
    storage = tmp_path / "storage"
    (tmp_path / "csv").mkdir()
    for f in range(4):
        rows = "\n".join(f"{i},{2 * i}" for i in range(f * 5, f * 5 + 5))
        (tmp_path / "csv" / f"part-{f}.csv").write_text(f"x,y\n{rows}\n")
    proc = run_script(tmp_path, f"""
        import ray
        import ray.data
        import ray.train
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        def train_fn(config):
            shard = ray.train.get_dataset_shard("train")
            epochs = [[int(x) for batch in shard.iter_torch_batches(batch_size=3) for x in batch["x"]]
                      for _ in range(2)]
            assert epochs[0] == epochs[1], epochs  # walked again each epoch
            ray.train.report({{"xs": epochs[0]}})
            return epochs[0]

        dataset = ray.data.read_csv({str(tmp_path / "csv")!r}).map(lambda r: {{"x": r["x"], "y2": r["y"] * 2}})
        result = TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=2),
                              datasets={{"train": dataset}},
                              run_config=RunConfig(name="csv", storage_path={str(storage)!r})).fit()
        print("returned", result.return_value)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "returned [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" in proc.stdout


def test_a_map_batches_function_that_raises_in_a_worker_fails_the_run_naming_it(tmp_path):
    proc = run_script(tmp_path, f"""
        import ray.data
        import ray.train
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        def broken(batch):
            return {{"x": batch["no_such_column"]}}

        def train_fn(config):
            for batch in ray.train.get_dataset_shard("train").iter_batches(batch_size=2):
                pass

        TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=2),
                     datasets={{"train": ray.data.from_items([{{"x": i}} for i in range(8)]).map_batches(broken)}},
                     run_config=RunConfig(name="broken", storage_path={str(tmp_path / "storage")!r})).fit()
    """)
    assert proc.returncode != 0
    assert "map_batches(broken) raised KeyError" in proc.stderr and "no_such_column" in proc.stderr, \
        proc.stderr[-3000:]


def test_ray_trains_framework_integrations_are_outlasts(tmp_path):
    proc = run_script(tmp_path, """
        import ray.train.lightning
        import outlast.train.lightning, outlast.train.huggingface.transformers, outlast.train.xgboost, outlast.train.jax
        from ray.train.lightning import RayDDPStrategy, RayTrainReportCallback, prepare_trainer
        from ray.train.huggingface.transformers import RayTrainReportCallback as HFCallback
        from ray.train.xgboost import RayTrainReportCallback as XGBCallback, XGBoostTrainer
        from ray.train.v2.xgboost import XGBoostTrainer as V2XGBoostTrainer
        from ray.train.v2.jax import JaxTrainer, JaxConfig
        from ray.train.v2.jax.jax_trainer import JaxTrainer as ModuleJaxTrainer
        import outlast.train.lightgbm
        from ray.train.lightgbm import LightGBMTrainer, RayTrainReportCallback as LGBCallback, get_network_params
        from ray.train.v2.lightgbm import LightGBMTrainer as V2LightGBMTrainer
        assert RayDDPStrategy is ray.train.lightning.RayDDPStrategy is outlast.train.lightning.RayDDPStrategy
        assert RayTrainReportCallback.CHECKPOINT_NAME == "checkpoint.ckpt" and prepare_trainer is outlast.train.lightning.prepare_trainer
        assert HFCallback is outlast.train.huggingface.transformers.RayTrainReportCallback and HFCallback.CHECKPOINT_NAME == "checkpoint"
        assert XGBCallback.CHECKPOINT_NAME == "model.ubj" and XGBoostTrainer is V2XGBoostTrainer is outlast.train.xgboost.XGBoostTrainer
        assert JaxTrainer is ModuleJaxTrainer is outlast.train.jax.JaxTrainer and JaxConfig is outlast.train.jax.JaxConfig
        assert LightGBMTrainer is V2LightGBMTrainer is outlast.train.lightgbm.LightGBMTrainer
        assert LGBCallback.CHECKPOINT_NAME == "model.txt" and get_network_params is outlast.train.lightgbm.get_network_params
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_ray_train_integration_outlast_lacks_stops_naming_what_is_and_is_not_supported(tmp_path):
    proc = run_script(tmp_path, """
        import ray.train.torch

        from ray.train.tensorflow import TensorflowTrainer
    """)
    assert proc.returncode == 2
    assert f"import ray.train.tensorflow at {tmp_path / 'script.py'}, line 4 is not supported" in proc.stderr
    for supported in ("ray.train.lightning", "ray.train.huggingface.transformers", "ray.train.xgboost",
                      "ray.train.lightgbm", "ray.train.v2.jax"):
        assert supported in proc.stderr.split("nothing else of Ray")[0]
    assert "ray.train.tensorflow" in proc.stderr.split("nothing else of Ray")[1]
