"""`DataParallelTrainer.fit()`: plan the run, find or start a node, hand over to the controller."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import cloudpickle
import zmq

from outlast.client.discovery import attach
from outlast.client.preload import with_default
from outlast.train.worker_main import WorkerPayload
from outlast.controller.driver_lease import LeaseKeeper
from outlast.controller.resize import Elastic
from outlast.train.live.store_host import LiveStore, host_of
from outlast.controller.report_log import ReportLog
from outlast.controller.runstate import RunBook
from outlast.controller.agent_group import AgentGroup
from outlast.controller.metrics import DriverMetrics
from outlast.controller.output import OutputPrinter
from outlast.controller.progress import ProgressLine, lease_line
from outlast.metrics import DRIVER_PORT_VAR, endpoint_from_env
from outlast.controller.runtime import Controller, RunPlan, Timeouts
from outlast.protocol import messages as m
from outlast.protocol.run_credential import issue
from outlast.train import return_value
from outlast.protocol.transport import route_ip
from outlast.runenv import carried_env, importable_paths
from outlast.storage import open_storage
from outlast.storage.run_store import RunStore
from outlast.train.backend import Backend, WithDatasets
from outlast.client.embedded import EmbeddedNode
from outlast.train.config import DEFAULT_STORAGE, RunConfig, ScalingConfig, worker_range
from outlast.train.data import DataConfig, to_source
from outlast.errors import TrainingFailedError, classify
from outlast.trace import mark
from outlast.train.result import Result, build_result

if TYPE_CHECKING:
    from outlast.isolation.config import IsolationConfig

log = logging.getLogger("outlast.train")

class DataParallelTrainer:
    """Runs `train_loop_per_worker` on `scaling_config.num_workers` workers, restarting on failure."""

    backend_cls: type[Backend] = Backend

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        backend: Backend | None = None,
        isolation: "IsolationConfig | None" = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        metadata: dict[str, Any] | None = None,
        resume_from_checkpoint: Any = None,
        validation_config: Any = None,
    ) -> None:
        """`isolation`: resource isolation for the node that `fit()` starts when none is running
        (a running node keeps its own settings). `datasets`: read in each worker with
        `get_dataset_shard(name)`, split between the ranks as `dataset_config` says."""
        if resume_from_checkpoint is not None:
            raise ValueError("resume_from_checkpoint is not supported: a run continues from its own latest checkpoint "
                             "when started again with the same RunConfig(name, storage_path); to start from another "
                             "checkpoint, load it in the train function (pass its path in train_loop_config)")
        if validation_config is not None:
            raise ValueError("validation_config is not supported: validate in the train function and report the "
                             "validation metrics with the checkpoint")
        if not callable(train_loop_per_worker):
            raise TypeError(f"train_loop_per_worker must be a function, got {type(train_loop_per_worker).__name__}")
        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise TypeError(f"train_loop_config must be a dict, got {type(train_loop_config).__name__}")
        for name, value, cls in (("scaling_config", scaling_config, ScalingConfig),
                                 ("run_config", run_config, RunConfig)):
            if value is not None and not isinstance(value, cls):
                how = f"{cls.__name__}(**{value!r})" if isinstance(value, dict) else f"a {cls.__name__}"
                raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}: write {name}={how}")
        self.train_fn = train_loop_per_worker
        self.train_loop_config = train_loop_config
        self.scaling_config = scaling_config or ScalingConfig()
        self.run_config = run_config or RunConfig()
        self.backend = backend or self.backend_cls()
        if datasets:
            if not isinstance(datasets, dict):
                raise TypeError(f"datasets must be a dict of name -> dataset, got {type(datasets).__name__}")
            for name, data in datasets.items():
                to_source(name, data)  # refuses what a worker could not read, before anything starts
            dataset_config = dataset_config or DataConfig()
            dataset_config.check_world(worker_range(self.scaling_config)[1])
            self.backend = WithDatasets(self.backend, datasets, dataset_config)
        self.isolation = isolation
        self.metadata = metadata

    def fit(self) -> Result:
        """Train to the end and return the result; raise `TrainingFailedError` if the run fails.

        Relaunched with the same `RunConfig(name, storage_path)` after its driver died, it
        continues from the latest committed checkpoint; on a finished run it returns that
        run's result without training again.
        """
        mark("driver.fit")
        _ensure_logging()
        rc = self.run_config
        name = rc.name or time.strftime("outlast_train_%Y-%m-%d_%H-%M-%S")
        storage = open_storage(rc.storage_path or os.environ.get("OUTLAST_STORAGE_PATH") or DEFAULT_STORAGE)
        store = RunStore(storage, name)
        store.check_writable()
        try:
            payload = cloudpickle.dumps(WorkerPayload(_with_ray_alias(self.train_fn), self.train_loop_config,
                                                      self.backend, storage, name, main_file=_main_file()))
        except Exception as e:
            raise TypeError(f"the train function or its config cannot be pickled to send to workers: {e}") from e
        lease = LeaseKeeper(store, ttl_s=float(os.environ.get("OUTLAST_DRIVER_LEASE_S", "10")))
        progress = ProgressLine(capacity_s=_timeouts_from_env().capacity_s)
        try:
            lease.acquire(on_wait=lambda why, left: progress.show(("lease", lease_line(why, left)), time.monotonic()))
        finally:
            progress.close()
        try:
            book = RunBook.open(store, name, time.time())
            if book.state.status == "finished":
                log.info("run %s already finished; returning its result (choose another RunConfig(name=...) "
                         "to train again)", storage.uri(name))
                return _result(book, storage, store, rc)
            if book.close_dead_drivers_attempt(time.time(), lease.previous.renewed_at if lease.previous else None):
                log.info("resuming run %s after its driver died, from %s", storage.uri(name),
                         book.state.latest_checkpoint or "scratch")
            try:
                return_key = self._run(book, payload, name, lease, progress)
            except TrainingFailedError as e:
                raise classify(e) from e.__cause__
            return _result(book, storage, store, rc, return_key)
        finally:
            lease.release()

    def _run(self, book: RunBook, payload: bytes, name: str, lease: LeaseKeeper, progress: ProgressLine) -> bytes:
        """Drive the run to its end; the key its workers seal their return value with (train/return_value.py)."""
        rc = self.run_config
        low, n = worker_range(self.scaling_config)
        elastic = Elastic(low, n, self.scaling_config.elastic_resize_monitor_interval_s) if low < n else None
        plan = RunPlan(
            name=name, book=book, world_size=n,
            workers=[m.WorkerSpec(rank=r, local_rank=r, local_world_size=n, node_rank=0, world_size=n)
                     for r in range(n)],
            payload=payload, max_failures=rc.failure_config.max_failures,
            num_to_keep=rc.checkpoint_config.num_to_keep,
            score_attribute=rc.checkpoint_config.checkpoint_score_attribute,
            score_order=rc.checkpoint_config.checkpoint_score_order,
            env={**carried_env(os.environ, rc.worker_runtime_env), **_checkpoint_order(rc)},
            cwd=os.getcwd(), sys_path=importable_paths(),
            rendezvous=self.backend.needs_rendezvous, timeouts=_timeouts_from_env(), lease=lease,
            max_preemption_failures=rc.failure_config.max_preemption_failures,
            preemption_grace_s=rc.failure_config.preemption_grace_s,
            relax_collectives=rc.failure_config.relax_collectives_on_preemption,
            per_worker=self._per_worker(), strategy=self.scaling_config.placement_strategy,
            duplicate_files=rc.checkpoint_config.duplicate_files, forward_output=rc.worker_output != "off",
            elastic=elastic, hang_timeout_s=rc.failure_config.hang_timeout_s,
            checkpoint_storage=rc.checkpoint_config.checkpoint_storage,
            live_recovery=rc.failure_config.live_recovery,
        )
        ctx = zmq.Context()
        access = embedded = None
        try:
            preload = with_default(self.backend.preload)
            node_args = self.isolation.to_args() if self.isolation else []
            access = attach(ctx, preload, node_args)
            if access.embedded is not None:
                embedded = EmbeddedNode(access.embedded, access.head_address, access.key, preload, node_args)
            elif self.isolation is not None and self.isolation.enable_resource_isolation:
                log.warning("an outlast cluster is already running at %s; its own isolation settings apply",
                            access.head_address)
            credential = issue(access.authenticator, access.key)
            plan.env.update(credential.env)  # workers never get the cluster key
            printer = OutputPrinter(prefixed=rc.worker_output == "prefixed") if plan.forward_output else None
            # The node's liveness comes from its table entry (its agent's pid, on this machine).
            group = AgentGroup(ctx, access.head_address, access.key, bind_host=route_ip(access.head_address),
                               output=printer)
            reports = ReportLog(book.store)
            # Live recovery's store, beside the controller that publishes in it, on the address its ranks reach.
            live = LiveStore.hosted(host_of(group.address)) if plan.live_recovery else None
            try:
                Controller(plan, group, watchers=[progress, reports, *_watchers(name)], live=live).run()
            finally:
                progress.close()
                reports.close()
                group.close(linger_ms=500 if embedded is None else 0)
                if printer is not None:
                    printer.close()
            return return_value.key_from_secret(credential.secret)
        finally:
            if embedded is not None:
                embedded.stop()
            if access is not None:
                access.stop_authenticator()
            ctx.term()

    def _per_worker(self) -> dict[str, float]:
        # Without a request, ranks are placed by count alone: a laptop runs 4 workers on 2 cores.
        sc = self.scaling_config
        need = {"GPU": 1.0} if sc.use_gpu else {}
        if sc.accelerator_type:
            need[f"accelerator_type:{sc.accelerator_type}"] = 0.001
        need.update({k: float(v) for k, v in (sc.resources_per_worker or {}).items()})
        return {k: v for k, v in need.items() if v > 0}



def _watchers(name: str) -> list:
    """What looks at the controller's loop besides the controller: the metrics, when asked for."""
    where = endpoint_from_env(DRIVER_PORT_VAR)
    if where is None:
        return []
    first = DriverMetrics.serving() is None
    metrics = DriverMetrics.shared(where)
    if first:
        log.info("serving the driver's metrics at %s", metrics.url)
    return [metrics.for_run(name)]


Trainer = DataParallelTrainer


def _result(book: RunBook, storage, store: RunStore, rc: RunConfig, return_key: bytes | None = None) -> Result:
    cc = rc.checkpoint_config
    return build_result(book.state, storage, store, cc.num_to_keep, cc.checkpoint_score_attribute,
                        cc.checkpoint_score_order, return_key=return_key)




def _checkpoint_order(rc: RunConfig) -> dict[str, str]:
    """How workers order get_all_reported_checkpoints(), as the Result orders best_checkpoints."""
    cc = rc.checkpoint_config
    out = {"OUTLAST_CHECKPOINT_STORAGE": cc.checkpoint_storage} if cc.checkpoint_storage != "storage" else {}
    if cc.checkpoint_score_attribute is not None:
        out["OUTLAST_CHECKPOINT_SCORE"] = f"{cc.checkpoint_score_order}:{cc.checkpoint_score_attribute}"
    return out


def _with_ray_alias(fn: Callable[..., Any]) -> Any:
    """Under `outlast run` the workers need `ray` to be outlast's before they import the function's module."""
    alias = sys.modules.get("outlast.compat.ray_alias")
    return alias.carry(fn) if alias is not None and alias.active() else fn


def _main_file() -> str | None:
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return str(Path(main_file).resolve()) if main_file else None


def _timeouts_from_env() -> Timeouts:
    env = os.environ
    defaults = Timeouts()
    return Timeouts(
        driver_lost_after_s=float(env.get("OUTLAST_DRIVER_TIMEOUT_S", defaults.driver_lost_after_s)),
        teardown_grace_s=float(env.get("OUTLAST_TEARDOWN_GRACE_S", defaults.teardown_grace_s)),
        worker_start_s=float(env.get("OUTLAST_WORKER_START_TIMEOUT_S", defaults.worker_start_s)),
        collective_warn_s=float(env.get("OUTLAST_COLLECTIVE_WARN_INTERVAL_S", defaults.collective_warn_s)),
        collective_timeout_s=float(env.get("OUTLAST_COLLECTIVE_TIMEOUT_S", defaults.collective_timeout_s)),
        capacity_s=float(env.get("OUTLAST_CAPACITY_TIMEOUT_S", defaults.capacity_s)),
        node_lost_after_s=float(env.get("OUTLAST_NODE_TIMEOUT_S", defaults.node_lost_after_s)),
    )


def _ensure_logging() -> None:
    logger = logging.getLogger("outlast")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s outlast %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
