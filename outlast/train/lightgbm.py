"""`outlast.train.lightgbm`: distributed LightGBM, with Ray Train's names.

`LightGBMTrainer` gives every worker, before the train function, the network parameters of
LightGBM's own data-parallel learner: `get_network_params()` returns `num_machines`,
`machines` (every rank's address and port, in rank order) and `local_listen_port` (this rank's),
as Ray's does; the train function passes them to `lightgbm.train` with `tree_learner` and
`pre_partition`. Each rank listens on a free port of the address its node reaches rank 0's node
from, and the ranks exchange them through outlast's collective (`allgather`); a restarted
attempt picks new ports.

`RayTrainReportCallback` reports LightGBM's evaluation results after each round and saves the model
(`model.txt`, rank 0) every `frequency` rounds and at the end of training, as Ray's does; the train
function resumes as on Ray, from `RayTrainReportCallback.get_model(get_checkpoint())` passed to
`lightgbm.train(init_model=...)` with the rounds left. `PreemptionCheckpointCallback` (outlast's own)
saves the model on a drain notice.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from outlast import train
from outlast.protocol.transport import route_ip
from outlast.train._boosting import PreemptionWatch, ReportCallbackBase
from outlast.train.backend import Backend
from outlast.train.checkpoint import Checkpoint
from outlast.train.config import ScalingConfig
from outlast.train.context import TrainContext
from outlast.train.framework_trainer import BOOSTING_LEGACY_ARGS, FrameworkTrainer, refuse_boosting_legacy_args

__all__ = ["LightGBMConfig", "LightGBMTrainer", "PreemptionCheckpointCallback", "RayTrainReportCallback",
           "get_network_params", "normalize_pandas_for_lightgbm"]

log = logging.getLogger("outlast.train")

_network_params: dict[str, Any] | None = None  # this worker's, set before its train function starts


def get_network_params() -> dict[str, Any]:
    """LightGBM's network parameters for this worker (`num_machines`, `machines`, `local_listen_port`), to pass
    to `lightgbm.train` in a `LightGBMTrainer`'s train function; an empty dict elsewhere, as on Ray."""
    if _network_params is None:
        log.warning("get_network_params() was called outside a LightGBMTrainer's train function: it returns {}, "
                    "and lightgbm.train trains this worker's data alone. Call it inside the train function")
        return {}
    return dict(_network_params)


@dataclass
class LightGBMConfig:
    """Ray's LightGBMConfig has no settings either: the network parameters are all the set-up there is."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LightGBMBackend(Backend):
    needs_rendezvous = True  # MASTER_ADDR: rank 0's node, which each rank's address is the route to

    def __init__(self, config: LightGBMConfig | None = None) -> None:
        self.config = config or LightGBMConfig()

    def on_start(self, context: TrainContext) -> None:
        global _network_params
        host = route_ip(os.environ.get("MASTER_ADDR", "127.0.0.1") + ":9")
        mine = (host, _free_port(host))
        every = train.collective.allgather(mine)
        _network_params = {
            "num_machines": context.world_size,
            "machines": ",".join(f"{ip}:{port}" for ip, port in (every[r] for r in sorted(every))),
            "local_listen_port": mine[1],
        }

    def on_shutdown(self) -> None:
        global _network_params
        _network_params = None


def normalize_pandas_for_lightgbm(df):
    """Arrow-backed numeric and boolean columns as pandas' nullable NumPy dtypes, which LightGBM accepts
    (it refuses `int64[pyarrow]`); other columns as they are, as Ray's does."""
    import pandas as pd
    import pyarrow as pa

    mapping = {}
    for column, dtype in df.dtypes.items():
        if not isinstance(dtype, pd.ArrowDtype):
            continue
        arrow = dtype.pyarrow_dtype
        if pa.types.is_boolean(arrow):
            mapping[column] = "boolean"
        elif pa.types.is_integer(arrow):
            mapping[column] = f"{'Int' if pa.types.is_signed_integer(arrow) else 'UInt'}{arrow.bit_width}"
        elif pa.types.is_floating(arrow):
            mapping[column] = f"Float{arrow.bit_width}"
    return df.astype(mapping) if mapping else df


def _eval_results(env) -> dict[str, dict[str, float]]:
    """LightGBM's `evaluation_result_list` nested by data set; a cross-validation entry (with a standard
    deviation) gives "<metric>-mean" and "<metric>-stdv", as Ray's."""
    out: dict[str, dict[str, float]] = {}
    for entry in env.evaluation_result_list or []:
        data_name, metric, value = entry[:3]
        if len(entry) > 4:
            out.setdefault(data_name, {})[f"{metric}-mean"] = value
            out[data_name][f"{metric}-stdv"] = entry[4]
        else:
            out.setdefault(data_name, {})[metric] = value
    return out


class RayTrainReportCallback(ReportCallbackBase):
    """A `lightgbm.train` callback: reports the round's evaluation results (as "<valid name>-<metric>") after
    every round, and a checkpoint holding `filename` (rank 0's model) every `frequency` rounds (0: none
    during training) and after the last round when `checkpoint_at_end`. `metrics` picks (list) or renames
    ({reported: lightgbm's}) what is reported; `results_postprocessing_fn` gets the dict last."""

    CHECKPOINT_NAME = "model.txt"

    def __init__(self, metrics: str | list[str] | dict[str, str] | None = None, filename: str = CHECKPOINT_NAME,
                 frequency: int = 0, checkpoint_at_end: bool = True,
                 results_postprocessing_fn: Callable[[dict], dict] | None = None) -> None:
        super().__init__(metrics, filename, frequency, checkpoint_at_end, results_postprocessing_fn)

    @classmethod
    def get_model(cls, checkpoint: Checkpoint, filename: str = CHECKPOINT_NAME):
        """The booster saved in `checkpoint` by this callback."""
        from lightgbm import Booster

        with checkpoint.as_directory() as path:
            return Booster(model_file=Path(path, filename).as_posix())

    def __call__(self, env) -> None:
        report = self._report_dict(_eval_results(env))
        last = env.iteration == env.end_iteration - 1
        if (last and self._checkpoint_at_end) or self._checkpoints_after(env.iteration):
            self._save_and_report(report, env.model)
        else:
            train.report(report)


class PreemptionCheckpointCallback(RayTrainReportCallback):
    """outlast's own: on a drain notice (`get_preemption_info()`, the same round on every rank), the model
    after this round is saved and reported with the round's results, so the run moves without losing a
    round. Put it beside `RayTrainReportCallback` (same `filename`). `on_preemption` runs on that round,
    before the save: override it to log or flush what the save needs."""

    def __init__(self, metrics: str | list[str] | dict[str, str] | None = None,
                 filename: str = RayTrainReportCallback.CHECKPOINT_NAME) -> None:
        super().__init__(metrics=metrics, filename=filename, checkpoint_at_end=False)
        self._watch = PreemptionWatch()

    def __call__(self, env) -> None:
        info = self._watch.new_notice()
        if info is not None:
            self.on_preemption(env.model, info)
            self._save_and_report({**self._report_dict(_eval_results(env)), "preempted": True}, env.model)

    def on_preemption(self, model, info) -> None:
        """Called once per notice, on the round whose model it saves, before the save."""


class LightGBMTrainer(FrameworkTrainer):
    """Data-parallel LightGBM: `train_loop_per_worker` calls `lightgbm.train` on its shard with
    `get_network_params()`. `lightgbm_config`: a `LightGBMConfig`."""

    config_arg = "lightgbm_config"
    own_args = BOOSTING_LEGACY_ARGS

    def make_backend(self, config: LightGBMConfig | None, scaling_config: ScalingConfig) -> LightGBMBackend:
        return LightGBMBackend(config)

    def take_own_args(self, **legacy: Any) -> dict[str, Any]:
        return refuse_boosting_legacy_args("LightGBMTrainer", "lightgbm.train({..., 'tree_learner': 'data_parallel', "
                                           "'pre_partition': True, **get_network_params()}, train_set, "
                                           "callbacks=[RayTrainReportCallback()])", **legacy)

    @classmethod
    def get_model(cls, checkpoint: Checkpoint):
        raise DeprecationWarning("LightGBMTrainer.get_model is deprecated (as in Ray): use "
                                 "RayTrainReportCallback.get_model(checkpoint)")
