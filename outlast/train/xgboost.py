"""`outlast.train.xgboost`: distributed XGBoost, with Ray Train's names.

`XGBoostTrainer` runs the train function on every worker inside XGBoost's own collective
(`xgboost.collective.CommunicatorContext`), so `xgboost.train` on each worker's shard trains
one model together. Rank 0 starts XGBoost's `RabitTracker` for each attempt (Ray starts it in
its driver) and every rank learns its address from rank 0; XGBoost ranks follow the run's
ranks (`sortby="task"`). A restarted attempt starts a new tracker.

`RayTrainReportCallback` reports XGBoost's evaluation results after each round and saves the
model (`model.ubj`, rank 0) every `frequency` rounds and at the end, as Ray's does; the train
function resumes as on Ray, from `RayTrainReportCallback.get_model(get_checkpoint())` with the
rounds left. `PreemptionCheckpointCallback` (outlast's own) saves the model on a drain notice.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outlast import train
from outlast.train._boosting import PreemptionWatch, ReportCallbackBase
from outlast.train.backend import Backend
from outlast.train.checkpoint import Checkpoint
from outlast.train.config import ScalingConfig
from outlast.train.context import TrainContext
from outlast.train.framework_trainer import BOOSTING_LEGACY_ARGS, FrameworkTrainer, refuse_boosting_legacy_args

__all__ = ["PreemptionCheckpointCallback", "RayTrainReportCallback", "XGBoostConfig", "XGBoostTrainer"]

try:
    from xgboost.callback import TrainingCallback
except ImportError:
    TrainingCallback = object  # the trainer still loads in a driver without xgboost; the workers need it


@dataclass
class XGBoostConfig:
    """`xgboost_communicator`: "rabit", the only one XGBoost's Python package offers on CPUs and GPUs."""

    xgboost_communicator: str = "rabit"

    def __post_init__(self) -> None:
        if self.xgboost_communicator != "rabit":
            raise ValueError(f"XGBoostConfig(xgboost_communicator={self.xgboost_communicator!r}) is not supported: "
                             "the only communicator is 'rabit'")


class XGBoostBackend(Backend):
    needs_rendezvous = True  # MASTER_ADDR: rank 0's node, where the tracker listens

    def __init__(self, config: XGBoostConfig | None = None) -> None:
        self.config = config or XGBoostConfig()
        self._tracker: Any = None
        self._waiter: threading.Thread | None = None
        self._communicator: Any = None

    def on_start(self, context: TrainContext) -> None:
        if context.world_size == 1:
            return  # one worker trains alone, without a tracker (as Ray's V2 does)
        from xgboost.collective import CommunicatorContext
        from xgboost.tracker import RabitTracker

        args = None
        if context.world_rank == 0:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            self._tracker = RabitTracker(n_workers=context.world_size, host_ip=host, sortby="task")
            self._tracker.start()
            # worker_args() answers once the tracker listens; wait_for() serves the workers until they finish.
            self._waiter = threading.Thread(target=self._tracker.wait_for, daemon=True, name="xgboost-tracker")
            self._waiter.start()
            args = self._tracker.worker_args()
        args = dict(train.collective.broadcast_from_rank_zero(args))
        args["dmlc_task_id"] = f"[xgboost.outlast-rank={context.world_rank:08}]"
        self._communicator = CommunicatorContext(**args)
        self._communicator.__enter__()

    def on_shutdown(self) -> None:
        if self._communicator is not None:
            self._communicator.__exit__(None, None, None)
            self._communicator = None
        if self._waiter is not None:
            self._waiter.join(timeout=5)


class RayTrainReportCallback(ReportCallbackBase, TrainingCallback):
    """Reports the last round's evaluation results (as "<eval name>-<metric>") after every round, and a
    checkpoint holding `filename` (rank 0's model) every `frequency` rounds (0: none during training)
    and at the end when `checkpoint_at_end`. `metrics` picks (list) or renames ({reported: xgboost's})
    what is reported; `results_postprocessing_fn` gets the dict last."""

    CHECKPOINT_NAME = "model.ubj"

    def __init__(self, metrics: str | list[str] | dict[str, str] | None = None, filename: str = CHECKPOINT_NAME,
                 frequency: int = 0, checkpoint_at_end: bool = True,
                 results_postprocessing_fn: Callable[[dict], dict] | None = None) -> None:
        if TrainingCallback is object:
            raise ModuleNotFoundError("outlast.train.xgboost.RayTrainReportCallback needs xgboost: pip install xgboost")
        super().__init__(metrics, filename, frequency, checkpoint_at_end, results_postprocessing_fn)
        self._evals_log: dict | None = None
        self._last_checkpoint_iteration: int | None = None

    @classmethod
    def get_model(cls, checkpoint: Checkpoint, filename: str = CHECKPOINT_NAME):
        """The booster saved in `checkpoint` by this callback."""
        from xgboost import Booster

        with checkpoint.as_directory() as path:
            booster = Booster()
            booster.load_model(Path(path, filename).as_posix())
            return booster

    def after_iteration(self, model, epoch: int, evals_log: dict) -> bool:
        self._evals_log = evals_log
        report = self._report_dict(evals_log)
        if self._checkpoints_after(epoch):
            self._last_checkpoint_iteration = epoch
            self._save_and_report(report, model)
        else:
            train.report(report)
        return False

    def after_training(self, model):
        if not self._checkpoint_at_end:
            return model
        if self._last_checkpoint_iteration is not None \
                and model.num_boosted_rounds() - 1 == self._last_checkpoint_iteration:
            return model  # the last round is checkpointed already
        self._save_and_report(self._report_dict(self._evals_log) if self._evals_log else {}, model)
        return model


class PreemptionCheckpointCallback(RayTrainReportCallback):
    """outlast's own: on a drain notice (`get_preemption_info()`, the same round on every rank), the model
    after this round is saved and reported with the round's results, so the run moves without losing a
    round. Put it beside `RayTrainReportCallback` (same `filename`). `on_preemption` runs on that round,
    before the save: override it to log or flush what the save needs."""

    def __init__(self, metrics: str | list[str] | dict[str, str] | None = None,
                 filename: str = RayTrainReportCallback.CHECKPOINT_NAME) -> None:
        super().__init__(metrics=metrics, filename=filename, checkpoint_at_end=False)
        self._watch = PreemptionWatch()

    def after_iteration(self, model, epoch: int, evals_log: dict) -> bool:
        info = self._watch.new_notice()
        if info is not None:
            self.on_preemption(model, info)
            self._save_and_report({**self._report_dict(evals_log), "preempted": True}, model)
        return False

    def on_preemption(self, model, info) -> None:
        """Called once per notice, on the round whose model it saves, before the save."""


class XGBoostTrainer(FrameworkTrainer):
    """Data-parallel XGBoost: `train_loop_per_worker` calls `xgboost.train` on its shard, in XGBoost's collective.
    `xgboost_config`: an `XGBoostConfig`."""

    config_arg = "xgboost_config"
    own_args = BOOSTING_LEGACY_ARGS

    def make_backend(self, config: XGBoostConfig | None, scaling_config: ScalingConfig) -> XGBoostBackend:
        return XGBoostBackend(config)

    def take_own_args(self, **legacy: Any) -> dict[str, Any]:
        return refuse_boosting_legacy_args("XGBoostTrainer", "xgboost.train(params, dtrain, num_boost_round, "
                                           "callbacks=[RayTrainReportCallback()])", **legacy)

    @classmethod
    def get_model(cls, checkpoint: Checkpoint):
        raise DeprecationWarning("XGBoostTrainer.get_model is deprecated (as in Ray): use "
                                 "RayTrainReportCallback.get_model(checkpoint)")
