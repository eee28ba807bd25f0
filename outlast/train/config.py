"""Run configuration, with the names and shapes of Ray Train's configs."""

from __future__ import annotations

import math
import os
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from outlast.runenv import check_runtime_env


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass
class ScalingConfig:
    """`resources_per_worker` (e.g. {"CPU": 4, "GPU": 1, "memory": 8e9}) is what each rank holds on
    its node; nodes offer what `outlast start --num-cpus/--num-gpus/--memory/--resources` says.
    `use_gpu` asks one GPU per worker. PACK fills a node before the next; SPREAD deals ranks
    round-robin; STRICT_PACK needs one node; STRICT_SPREAD one node per rank.

    `num_workers=(min_workers, max_workers)` makes the run elastic, as in Ray Train: it asks for
    `max_workers`, starts as soon as `min_workers` fit, restarts at once on what is left (at least
    `min_workers`) when a node is lost or drained with nowhere to move, and grows when a node joins or
    frees up. Growth is not polled: the controller sees the node table change and tells the loop at
    once, through `get_preemption_info()` (reason "resize"), so it saves a checkpoint and the run
    restarts larger without losing a step. `elastic_resize_monitor_interval_s` keeps Ray's name for
    the one knob left: the least time between two resizes, so that a node that comes and goes does
    not restart the run every time. A fixed int keeps a fixed size."""

    num_workers: int | tuple[int, int] = 1
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None
    placement_strategy: str = "PACK"
    # Asks each rank a sliver of the custom resource "accelerator_type:<type>", which a node offers
    # with `outlast start --resources accelerator_type:A100=1` (the resource name Ray uses).
    accelerator_type: str | None = None
    label_selector: dict[str, str] | list[dict[str, str]] | None = None
    elastic_resize_monitor_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, (tuple, list)):
            if len(self.num_workers) != 2:
                raise ValueError(f"ScalingConfig.num_workers must be an int or a pair (min_workers, max_workers), "
                                 f"got {self.num_workers!r}")
            low, high = self.num_workers
            _check_int("ScalingConfig.num_workers[0] (min_workers)", low, 1)
            _check_int("ScalingConfig.num_workers[1] (max_workers)", high, 1)
            if low > high:
                raise ValueError(f"ScalingConfig.num_workers=(min_workers, max_workers) needs min_workers <= "
                                 f"max_workers, got {self.num_workers!r}")
            self.num_workers = (low, high)
        else:
            _check_int("ScalingConfig.num_workers", self.num_workers, 1)
        interval = self.elastic_resize_monitor_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval < math.inf:
            raise ValueError(f"ScalingConfig.elastic_resize_monitor_interval_s must be a finite number of seconds "
                             f">= 0, got {interval!r}")
        if self.label_selector:
            raise ValueError(
                "ScalingConfig(label_selector=...) is not supported: outlast places ranks by resources. Start the "
                "nodes you mean with `outlast start --resources NAME=N` and ask for that resource with "
                "ScalingConfig(resources_per_worker={NAME: 1})")
        if self.accelerator_type is not None and (not isinstance(self.accelerator_type, str)
                                                  or not self.accelerator_type):
            raise ValueError(f"ScalingConfig.accelerator_type must be a non-empty string such as 'A100', "
                             f"got {self.accelerator_type!r}")
        if not isinstance(self.use_gpu, bool):
            raise ValueError(f"ScalingConfig.use_gpu must be True or False, got {self.use_gpu!r}")
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(
                f"ScalingConfig.placement_strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, "
                f"got {self.placement_strategy!r}"
            )
        if self.resources_per_worker is not None and not isinstance(self.resources_per_worker, dict):
            raise ValueError(f'ScalingConfig.resources_per_worker must be a dict like {{"CPU": 2, "GPU": 1}}, '
                             f"got {self.resources_per_worker!r}")
        for key, amount in (self.resources_per_worker or {}).items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"ScalingConfig.resources_per_worker has a resource name {key!r}; names are strings "
                                 "such as 'CPU', 'GPU', 'memory'")
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 <= amount < math.inf:
                raise ValueError(f"ScalingConfig.resources_per_worker[{key!r}] must be a finite number >= 0, "
                                 f"got {amount!r}")


@dataclass
class FailureConfig:
    """`max_failures`: how many times a failed run restarts; 0 never, -1 forever.

    Preemptions draw on their own budget, `max_preemption_failures` (-1: forever). After a
    notice, the workers keep running until a checkpoint reported after it is committed, or
    until the deadline plus `preemption_grace_s` (120 s when the notice has no deadline).
    """

    max_failures: int = 0
    max_preemption_failures: int = -1
    preemption_grace_s: float = 0.0
    # On a preemption, report() and get_preemption_info() go on with the ranks that survive
    # when the preempted ranks' node goes away (rank 0 included).
    relax_collectives_on_preemption: bool = False
    # A rank without progress (report, get_preemption_info, collectives, outlast.train.heartbeat()) this
    # long is hung: every rank's stacks are taken, then the attempt restarts as a failure. None adapts to
    # the run: 10 x its slowest step, never under 5 minutes (outlast/controller/hangs.py says why).
    hang_timeout_s: float | None = None
    # A rank's death costs at most one step: the other ranks keep running, and a replacement forked for the lost
    # rank takes the state from them (docs/guide/live-recovery.md). The loop names its state and makes each step
    # through outlast.train.torch.LiveTraining. Each death is a failure charged to max_failures.
    live_recovery: bool = False

    def __post_init__(self) -> None:
        _check_int("FailureConfig.max_failures", self.max_failures, -1)
        if not isinstance(self.live_recovery, bool):
            raise ValueError(f"FailureConfig.live_recovery must be True or False, got {self.live_recovery!r}")
        t = self.hang_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= math.inf):
            raise ValueError(f"FailureConfig.hang_timeout_s must be None (adapts to the run) or a number of seconds "
                             f"> 0 (math.inf: never), got {t!r}")
        _check_int("FailureConfig.max_preemption_failures", self.max_preemption_failures, -1)
        if not isinstance(self.relax_collectives_on_preemption, bool):
            raise ValueError(f"FailureConfig.relax_collectives_on_preemption must be True or False, "
                             f"got {self.relax_collectives_on_preemption!r}")
        if isinstance(self.preemption_grace_s, bool) or not isinstance(self.preemption_grace_s, (int, float)) \
                or not 0 <= self.preemption_grace_s < math.inf:
            raise ValueError(f"FailureConfig.preemption_grace_s must be a finite number of seconds >= 0, "
                             f"got {self.preemption_grace_s!r}")


@dataclass
class CheckpointConfig:
    """Which committed checkpoints to keep (the latest always is), and what to do when ranks write one
    file with different contents: keep rank 0's copy and say so ("keep_rank0"; "keep_one" is accepted as
    its former name), or refuse the checkpoint ("fail").

    `checkpoint_storage`: where a checkpoint must be for `report()` to return (docs/guide/memory-tier.md).
    "storage" (the default): in `storage_path`, with copies in the nodes' memory to restore from faster.
    "memory": in the memory of two nodes in different failure domains, and never uploaded; a run that
    loses both nodes at once goes back to its newest checkpoint still held, or starts over."""

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"
    duplicate_files: str = "keep_rank0"
    checkpoint_storage: str = "storage"

    def __post_init__(self) -> None:
        if self.duplicate_files == "keep_one":
            self.duplicate_files = "keep_rank0"
        if self.duplicate_files not in ("keep_rank0", "fail"):
            raise ValueError(f"CheckpointConfig.duplicate_files must be 'keep_rank0' (rank 0's copy) or 'fail', "
                             f"got {self.duplicate_files!r}")
        if self.checkpoint_storage not in CHECKPOINT_STORAGE:
            raise ValueError(f"CheckpointConfig.checkpoint_storage must be 'storage' (durable in storage_path, the "
                             f"default) or 'memory' (in the memory of two nodes only, never uploaded), got "
                             f"{self.checkpoint_storage!r}")
        if self.num_to_keep is not None:
            _check_int("CheckpointConfig.num_to_keep", self.num_to_keep, 1)
        if self.checkpoint_score_attribute is not None and not isinstance(self.checkpoint_score_attribute, str):
            raise ValueError(f"CheckpointConfig.checkpoint_score_attribute must be the name of a reported metric, "
                             f"got {self.checkpoint_score_attribute!r}")
        if self.checkpoint_score_order not in ("max", "min"):
            raise ValueError(
                f"CheckpointConfig.checkpoint_score_order must be 'max' or 'min', got {self.checkpoint_score_order!r}"
            )




WORKER_OUTPUT_MODES = ("prefixed", "plain", "off")
DEFAULT_STORAGE = "~/outlast_results"
CHECKPOINT_STORAGE = ("storage", "memory")


@dataclass
class RunConfig:
    """`worker_runtime_env` may set `env_vars` for the workers; the workers otherwise run with the
    driver's environment, working directory and import path, on the packages installed on their node."""

    name: str | None = None
    storage_path: str | os.PathLike[str] | None = None
    failure_config: FailureConfig = field(default_factory=FailureConfig)
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    storage_filesystem: Any = None
    callbacks: list[Any] | None = None
    worker_runtime_env: dict[str, Any] | None = None
    # The workers' stdout and stderr on the driver's stdout: "prefixed" (`[rank R NODE aA] line`),
    # "plain" (the lines alone) or "off" (kept only in each rank's log file on its node).
    worker_output: str = "prefixed"

    def __post_init__(self) -> None:
        if self.storage_filesystem is not None:
            raise ValueError(
                "RunConfig(storage_filesystem=...) is not supported: give storage_path as a URL that fsspec "
                "understands (s3://bucket/prefix, gs://..., a local path), with credentials and endpoint the usual "
                "way for that store (AWS_ENDPOINT_URL for S3-compatible servers)")
        if self.callbacks:
            raise ValueError(
                "RunConfig(callbacks=...) is not supported: outlast calls no code in the driver during a run. Log "
                "from the train function on rank 0, or read Result.metrics_dataframe and the run's history "
                "({storage_path}/{name}/run_state.json) after fit()")
        if self.failure_config is None:
            self.failure_config = FailureConfig()
        if self.checkpoint_config is None:
            self.checkpoint_config = CheckpointConfig()
        _check_config("RunConfig.failure_config", self.failure_config, FailureConfig)
        _check_config("RunConfig.checkpoint_config", self.checkpoint_config, CheckpointConfig)
        if self.name is not None:
            check_run_name(self.name)
        check_runtime_env(self.worker_runtime_env)
        if self.worker_output not in WORKER_OUTPUT_MODES:
            raise ValueError(f"RunConfig.worker_output must be one of {', '.join(map(repr, WORKER_OUTPUT_MODES))}, "
                             f"got {self.worker_output!r}")
        if self.storage_path is not None and not isinstance(self.storage_path, (str, os.PathLike)):
            raise ValueError(f"RunConfig.storage_path must be a path or a URL string, got {self.storage_path!r}")
        if self.storage_path is not None and not os.fspath(self.storage_path).strip():
            # An empty path is not "the default": it is more likely a variable that was never set.
            raise ValueError(f"RunConfig.storage_path is {os.fspath(self.storage_path)!r}, which names no directory: "
                             f"give a directory or a URL (s3://bucket/prefix), or leave it None for "
                             f"$OUTLAST_STORAGE_PATH, else {DEFAULT_STORAGE}")


# The run is a directory named after it, and each node keeps its ranks' output in a directory
# "{name}-{run id}" (13 characters more): both must fit in one file name, 255 bytes on Linux's file systems.
NAME_MAX = 255
MAX_NAME_BYTES = NAME_MAX - 13


def check_run_name(name: object) -> None:
    """A run's name is one file name: raise ValueError saying what is wrong with it, and what a name may be."""
    allowed = (f"a name is one directory name of at most {MAX_NAME_BYTES} bytes (UTF-8), other than '.' and '..', "
               "without '/' or control characters (newline, tab, NUL, ...)")
    if not isinstance(name, str):
        raise ValueError(f"RunConfig(name=...) must be a string or None (a name made from the time), "
                         f"got {type(name).__name__}: {allowed}")
    if name in ("", ".", ".."):
        # "." and ".." would put the run's files in storage_path itself or above it.
        why = "is empty (None, the default, names the run after the time)" if not name else f"is {name!r}"
        raise ValueError(f"RunConfig(name=...) {why}: {allowed}")
    if "/" in name:
        raise ValueError(f"RunConfig(name={name!r}) has a '/': {allowed}")
    bad = next((c for c in name if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        raise ValueError(f"RunConfig(name={name!r}) has the control character {bad!r}: {allowed}")
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise ValueError(f"RunConfig(name=...) is {size} bytes long ({name[:40]!r}...): {allowed}")


def worker_range(sc: ScalingConfig) -> tuple[int, int]:
    """(min_workers, max_workers); equal for a fixed size."""
    n = sc.num_workers
    return (n[0], n[1]) if isinstance(n, tuple) else (n, n)


def _check_config(name: str, value: object, cls: type) -> None:
    if isinstance(value, dict):
        raise TypeError(f"{name} must be a {cls.__name__}, got a dict: write {name.split('.')[-1]}="
                        f"{cls.__name__}(**{value!r})")
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
