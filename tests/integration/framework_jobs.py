"""Train functions for the framework tests (Lightning, Transformers, XGBoost, JAX), importable by the workers.

Each is written as Ray's guides write it (the integration's callbacks, resume from `get_checkpoint()`),
tiny and on synthetic data, and logs each step it starts (`event="step"`) and where it resumed from
(`event="start"`) and the step of the checkpoint a drain notice made it save (`event="jit"`) through `tests.integration.jobs.log_event`. `config["kill"] = {"rank": r, "step": s}`
SIGKILLs rank r when it reaches step s in the first attempt; `config["step_sleep"]` slows each step
so that a drain lands mid-run.
"""

from __future__ import annotations

import os
import signal
import time

from outlast import train
from tests.integration.jobs import log_event, read_events


def _maybe_die(config: dict, step: int) -> None:
    kill = config.get("kill")
    ctx = train.get_context()
    if kill and ctx.get_attempt() == 1 and ctx.get_world_rank() == kill["rank"] and step == kill["step"]:
        # Die once every other rank has begun the step before: ranks with no collective between them (the JAX
        # loop) run apart, and one ahead would die while another is still in the report() of a checkpoint
        # the test expects committed. Ranks in lockstep have begun it already.
        others = set(range(ctx.get_world_size())) - {ctx.get_world_rank()}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not others <= {
                e["rank"] for e in read_events(config["events"])
                if e["event"] == "step" and e["attempt"] == 1 and e["step"] >= step - 1}:
            time.sleep(0.01)
        log_event(config, event="fault", step=step)
        os.kill(os.getpid(), signal.SIGKILL)


def _step(config: dict, step: int) -> None:
    _maybe_die(config, step)
    log_event(config, event="step", step=step, node_id=os.environ.get("OUTLAST_NODE_ID"))
    time.sleep(config.get("step_sleep", 0.0))


def lightning_loop(config: dict) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from outlast.train.lightning import (
        PreemptionCheckpointCallback, RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer,
    )

    class LoggedJit(PreemptionCheckpointCallback):
        def on_preemption(self, trainer, info):
            log_event(config, event="jit", step=trainer.global_step)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss, on_step=True, on_epoch=False)
            return loss

        def on_train_batch_start(self, batch, batch_idx):
            _step(config, self.trainer.global_step)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=generator), torch.randn(64, 1, generator=generator))
    trainer = pl.Trainer(
        max_epochs=config["epochs"], devices="auto", accelerator="cpu", strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()], callbacks=[RayTrainReportCallback(), LoggedJit()],
        enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
    )
    trainer = prepare_trainer(trainer)
    checkpoint = train.get_checkpoint()
    if checkpoint is None:
        log_event(config, event="start", restored_step=None)
        trainer.fit(Tiny(), DataLoader(data, batch_size=4))
        return
    with checkpoint.as_directory() as d:
        path = os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME)
        log_event(config, event="start", restored_step=torch.load(path, weights_only=False)["global_step"])
        trainer.fit(Tiny(), DataLoader(data, batch_size=4), ckpt_path=path)


def transformers_loop(config: dict) -> None:
    import torch
    import transformers
    from torch.utils.data import Dataset

    from outlast.train.huggingface.transformers import (
        PreemptionCheckpointCallback, RayTrainReportCallback, prepare_trainer,
    )

    class Synthetic(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, 32, (8,), generator=g)
            return {"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long), "labels": ids % 2}

    class Steps(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            _step(config, state.global_step)

    class LoggedJit(PreemptionCheckpointCallback):
        def on_preemption(self, state, info):
            log_event(config, event="jit", step=state.global_step)

    model_config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=16, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.BertForTokenClassification(model_config)
    args = transformers.TrainingArguments(
        output_dir=config["output_dir"], num_train_epochs=config["epochs"], per_device_train_batch_size=4,
        save_strategy="steps", save_steps=config["save_steps"], logging_steps=1, report_to=[],
        use_cpu=True, disable_tqdm=True, save_only_model=False,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Synthetic(),
                                   callbacks=[Steps(), RayTrainReportCallback(), LoggedJit()])
    trainer = prepare_trainer(trainer)
    checkpoint = train.get_checkpoint()
    if checkpoint is None:
        log_event(config, event="start", restored_step=None)
        trainer.train()
        return
    with checkpoint.as_directory() as d:
        path = os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME)
        state = transformers.TrainerState.load_from_json(os.path.join(path, "trainer_state.json"))
        log_event(config, event="start", restored_step=state.global_step)
        trainer.train(resume_from_checkpoint=path)


def xgboost_loop(config: dict) -> None:
    import numpy as np
    import xgboost

    from outlast.train.xgboost import PreemptionCheckpointCallback, RayTrainReportCallback

    rank, size = train.get_context().get_world_rank(), train.get_context().get_world_size()
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(256, 4))
    dtrain = xgboost.DMatrix(x, label=x @ np.array([1.0, -2.0, 0.5, 3.0]))

    class Steps(xgboost.callback.TrainingCallback):
        def before_iteration(self, model, epoch, evals_log):
            _step(config, model.num_boosted_rounds())
            return False

    class LoggedJit(PreemptionCheckpointCallback):
        def on_preemption(self, model, info):
            log_event(config, event="jit", step=model.num_boosted_rounds())

    checkpoint = train.get_checkpoint()
    model = RayTrainReportCallback.get_model(checkpoint) if checkpoint else None
    done = model.num_boosted_rounds() if model is not None else 0
    log_event(config, event="start", restored_step=done if model is not None else None, world_size=size,
              collective_size=xgboost.collective.get_world_size(), collective_rank=xgboost.collective.get_rank())
    xgboost.train({"tree_method": "hist", "max_depth": 2, "eta": 0.3}, dtrain, num_boost_round=config["rounds"] - done,
                  evals=[(dtrain, "train")], xgb_model=model, verbose_eval=False,
                  callbacks=[Steps(), LoggedJit(),
                             RayTrainReportCallback(frequency=config["frequency"])])


def lightgbm_loop(config: dict) -> None:
    import lightgbm
    import numpy as np

    from outlast.train.lightgbm import PreemptionCheckpointCallback, RayTrainReportCallback, get_network_params

    rank, size = train.get_context().get_world_rank(), train.get_context().get_world_size()
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(256, 4))
    data = lightgbm.Dataset(x, label=x @ np.array([1.0, -2.0, 0.5, 3.0]))

    def steps(env):
        _step(config, env.iteration)
    steps.before_iteration = True

    class LoggedJit(PreemptionCheckpointCallback):
        def on_preemption(self, model, info):
            log_event(config, event="jit", step=model.current_iteration())

    checkpoint = train.get_checkpoint()
    model = RayTrainReportCallback.get_model(checkpoint) if checkpoint else None
    done = model.current_iteration() if model is not None else 0
    network = get_network_params()
    log_event(config, event="start", restored_step=done if model is not None else None, world_size=size,
              num_machines=network["num_machines"], machines=network["machines"],
              local_listen_port=network["local_listen_port"])
    params = {"objective": "regression", "tree_learner": "data_parallel", "pre_partition": True, "num_leaves": 4,
              "min_data_in_leaf": 5, "verbose": -1, "num_threads": 1, **network}
    lightgbm.train(params, data, num_boost_round=config["rounds"] - done, init_model=model, valid_sets=[data],
                   valid_names=["train"],
                   callbacks=[steps, LoggedJit(), RayTrainReportCallback(frequency=config["frequency"])])


def jax_loop(config: dict) -> None:
    import json
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np

    from outlast.train import Checkpoint

    checkpoint = train.get_checkpoint()
    w, start = jnp.zeros(4), 0
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            with open(os.path.join(d, "state.json")) as f:
                saved = json.load(f)
            w, start = jnp.asarray(saved["w"]), saved["step"]
    log_event(config, event="start", restored_step=start if checkpoint else None,
              process_count=jax.process_count(), process_index=jax.process_index())
    x = np.random.default_rng(jax.process_index()).normal(size=(32, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0])
    grad = jax.jit(jax.grad(lambda w: jnp.mean((x @ w - y) ** 2)))
    saved_for = None
    for step in range(start, config["steps"]):
        _step(config, step)
        w = w - 0.05 * grad(w)
        info = train.get_preemption_info()
        jit = info is not None and info != saved_for
        due = (step + 1) % config["every"] == 0 or jit
        if jit:
            saved_for = info
            log_event(config, event="jit", step=step + 1)
        checkpoint = None
        if due and train.get_context().get_world_rank() == 0:
            d = tempfile.mkdtemp()
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"w": np.asarray(w).tolist(), "step": step + 1}, f)
            checkpoint = Checkpoint.from_directory(d)
        train.report({"step": step + 1}, checkpoint=checkpoint if due else None)


def make_trainer(framework: str, storage_path: str, config: dict):
    """The trainer of a framework's test run (`config` is its train_loop_config), as the tests and the
    relaunched drivers of tests/integration/framework_driver.py build it."""
    from outlast.train import FailureConfig, RunConfig, ScalingConfig

    env = {"JAX_PLATFORMS": "cpu"} if framework == "jax" else None  # Ray's way to JAX's runtime without accelerators
    common = dict(train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                  run_config=RunConfig(name="run", storage_path=storage_path, failure_config=FailureConfig(max_failures=1),
                                       worker_runtime_env={"env_vars": env} if env else None))
    if framework in ("lightning", "transformers"):
        from outlast.train.torch import TorchTrainer

        return TorchTrainer(lightning_loop if framework == "lightning" else transformers_loop, **common)
    if framework == "xgboost":
        from outlast.train.xgboost import XGBoostTrainer

        return XGBoostTrainer(xgboost_loop, **common)
    if framework == "lightgbm":
        from outlast.train.lightgbm import LightGBMTrainer

        return LightGBMTrainer(lightgbm_loop, **common)
    from outlast.train.jax import JaxConfig, JaxTrainer

    return JaxTrainer(jax_loop, jax_config=JaxConfig(use_gpu=True), **common)
