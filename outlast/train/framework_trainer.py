"""The shape Ray's framework trainers share (TorchTrainer, XGBoostTrainer, LightGBMTrainer), written once.

Each takes the train function, `train_loop_config`, its framework's config (`torch_config`,
`xgboost_config`, ...), the run's shared arguments, and a few of its own. A subclass names its config
argument and its own arguments and builds its backend; its signature, which Ray's users and the parity
table read, is made from those names (`__signature__`), in Ray's order.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

from outlast.train.backend import Backend
from outlast.train.config import ScalingConfig
from outlast.train.trainer import DataParallelTrainer

SHARED_ARGS = ("scaling_config", "run_config", "datasets", "dataset_config", "validation_config", "metadata",
               "resume_from_checkpoint")
# The legacy arguments of Ray's gradient-boosting trainers, refused there too.
BOOSTING_LEGACY_ARGS = ("label_column", "params", "num_boost_round")


class FrameworkTrainer(DataParallelTrainer):
    config_arg: ClassVar[str] = ""  # the framework config's argument, e.g. "torch_config"
    own_args: ClassVar[tuple[str, ...]] = ()  # after the shared ones, e.g. ("isolation",)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names = ("train_loop_config", cls.config_arg, *SHARED_ARGS, *cls.own_args)
        cls.__signature__ = inspect.Signature(
            [inspect.Parameter("train_loop_per_worker", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
            + [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in names])

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            given = type(self).__signature__.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise TypeError(f"{type(self).__name__}(): {e}") from None
        named = {name: given.get(name) for name in type(self).__signature__.parameters}
        train_fn = named.pop("train_loop_per_worker")
        config = named.pop(self.config_arg)
        own = {name: named.pop(name) for name in self.own_args}
        scaling = named["scaling_config"]
        backend = self.make_backend(config, scaling if isinstance(scaling, ScalingConfig) else ScalingConfig())
        super().__init__(train_fn, backend=backend, **named, **self.take_own_args(**own))

    def make_backend(self, config: Any, scaling_config: ScalingConfig) -> Backend:
        raise NotImplementedError

    def take_own_args(self, **own: Any) -> dict[str, Any]:
        """The subclass's own arguments: refuse them, or return what `DataParallelTrainer` takes of them."""
        return own


def refuse_boosting_legacy_args(trainer: str, fit: str, **legacy: Any) -> dict[str, Any]:
    if any(v is not None for v in legacy.values()):
        raise DeprecationWarning(f"{trainer}(label_column=, params=, num_boost_round=) is Ray's legacy API, deprecated "
                                 f"there and not offered here: pass a train_loop_per_worker that calls {fit}")
    return {}
