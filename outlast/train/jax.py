"""`outlast.train.jax`: SPMD JAX training, with the names of Ray Train's `ray.train.v2.jax`.

As on Ray, `jax.distributed.initialize(coordinator, num_processes, process_id)` runs in every
worker before the train function when `JaxConfig(use_tpu=True)` or `JaxConfig(use_gpu=True)`,
with rank 0's node and a port free there as the coordinator; `JAX_PLATFORMS`, when set, picks
the platform (so `JAX_PLATFORMS=cpu` with `use_gpu=True` runs JAX's multi-process runtime on
CPUs). Without either flag every worker is a JAX process of its own, as on Ray.

Tested here on CPUs only. The CUDA branch (one process per worker, its GPUs as
`CUDA_VISIBLE_DEVICES`) and the TPU branch follow Ray's code but have not run on such hardware.
A TPU slice's hosts fail together: start each of them with `outlast start --failure-domain
<slice>`, and a drain of one host drains the slice. Multi-slice runs (Ray's `MEGASCALE_*`
variables) and `ScalingConfig(use_tpu=, topology=)` are not offered.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

from outlast import train
from outlast.train.backend import Backend
from outlast.train.config import RunConfig, ScalingConfig
from outlast.train.context import TrainContext
from outlast.train.data import DataConfig
from outlast.train.trainer import DataParallelTrainer

log = logging.getLogger("outlast.train")

__all__ = ["JaxConfig", "JaxTrainer"]


@dataclass
class JaxConfig:
    use_tpu: bool = False
    use_gpu: bool = False

    def __post_init__(self) -> None:
        for name in ("use_tpu", "use_gpu"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"JaxConfig.{name} must be True or False, got {getattr(self, name)!r}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _platforms(config: JaxConfig) -> list[str]:
    """JAX_PLATFORMS as Ray sets it: the user's, else tpu or cuda from the config."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if not platforms and config.use_tpu:
        platforms = os.environ["JAX_PLATFORMS"] = "tpu"
    if not platforms and config.use_gpu:
        platforms = os.environ["JAX_PLATFORMS"] = "cuda"
    return platforms.split(",")


class JaxBackend(Backend):
    needs_rendezvous = True

    def __init__(self, config: JaxConfig, gpus_per_worker: float = 0) -> None:
        self.config = config
        self.gpus_per_worker = int(gpus_per_worker)
        self._initialized = False

    def on_start(self, context: TrainContext) -> None:
        if not (self.config.use_tpu or self.config.use_gpu):
            return
        port = os.environ.get("MASTER_PORT") or train.collective.broadcast_from_rank_zero(
            _free_port() if context.world_rank == 0 else None)
        coordinator = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}"
        platforms = _platforms(self.config)
        if "cuda" in platforms:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(self.gpus_per_worker))
        import jax

        if "cuda" in platforms and "tpu" not in platforms:
            devices = list(range(self.gpus_per_worker)) if self.gpus_per_worker > 0 else 0
            jax.distributed.initialize(coordinator, context.world_size, context.world_rank, devices)
        elif "tpu" in platforms or "cpu" in platforms:
            jax.distributed.initialize(coordinator, context.world_size, context.world_rank)
        else:
            return
        self._initialized = True
        log.info("jax.distributed initialized (%s), coordinator %s, process %d of %d", ",".join(platforms),
                 coordinator, context.world_rank, context.world_size)

    def on_shutdown(self) -> None:
        if not self._initialized:
            return
        try:
            import jax

            jax.distributed.shutdown()
        except Exception as e:  # the attempt is over either way; a failed shutdown must not hide its result
            log.warning("jax.distributed.shutdown() failed: %s", e)


class JaxTrainer(DataParallelTrainer):
    """Runs `train_loop_per_worker` on every worker, one JAX process each (see the module's docstring)."""

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict | None = None,
        jax_config: JaxConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        dataset_config: DataConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        validation_config: Any = None,
    ) -> None:
        scaling_config = scaling_config or ScalingConfig()
        jax_config = jax_config or JaxConfig(use_gpu=scaling_config.use_gpu)
        gpus = (scaling_config.resources_per_worker or {}).get("GPU", 1 if scaling_config.use_gpu else 0)
        super().__init__(
            train_loop_per_worker, train_loop_config=train_loop_config, scaling_config=scaling_config,
            run_config=run_config, backend=JaxBackend(jax_config, gpus), datasets=datasets,
            dataset_config=dataset_config, validation_config=validation_config,
        )
