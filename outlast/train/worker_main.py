"""What a freshly forked training worker does: become a clean process, run the train function.

The fork server runs it by module path (outlast/agent/zygote.py); the agent never imports it.

On an exception the worker writes what happened to its error file before exiting,
so the fork server can attach it to the exit it reports: the traceback reaches the
driver with the death, with no race between two channels.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass
from typing import Any, Callable

import cloudpickle
import msgspec
import zmq

from outlast.procutil import become_clean_process, user_traceback
from outlast.protocol import messages as m
from outlast.protocol.kinds import FailureKind
from outlast.protocol.run_credential import worker_key
from outlast.protocol.transport import connect_dealer, incarnation_from_env, live_group_rank_from_env, worker_identity
from outlast.runenv import worker_env
from outlast.threads import follow_cpu_share
from outlast.storage.base import Storage
from outlast.storage.restore import CorruptCheckpointError
from outlast.train import watch
from outlast.trace import mark


@dataclass
class WorkerPayload:
    """Everything about a run that a worker needs, pickled once by the driver."""

    train_fn: Callable[..., Any]
    train_loop_config: dict | None
    backend: Any  # outlast.train.backend.Backend
    storage: Storage
    run_dir: str
    main_file: str | None = None  # the driver's script, for tracebacks of functions defined in it


def _write_error(path: str, exc: BaseException, phase: str) -> None:
    # A checkpoint that does not verify is a failure outlast knows, whatever raised it in the rank.
    kind = FailureKind.CORRUPT_CHECKPOINT if isinstance(exc, CorruptCheckpointError) else None
    err = m.WorkerError(exc_type=type(exc).__name__, kind=kind, message=str(exc), phase=phase,
                        traceback=user_traceback(exc, __file__))
    try:
        with open(path, "wb") as f:
            f.write(msgspec.json.encode(err))
    except OSError:
        pass


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_with_filename(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def restore_source_filenames(fn: Callable[..., Any], filename: str) -> None:
    """cloudpickle ships functions of the driver's script by value and renames their file
    to '<dynamic-code>'; give them their file back so tracebacks show the source lines."""
    seen: set[int] = set()

    def fix(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType) and obj.__code__.co_filename == "<dynamic-code>":
            obj.__code__ = _with_filename(obj.__code__, filename)
            for value in list(obj.__globals__.values()):
                fix(value)
        elif isinstance(obj, type) and obj.__module__ == "__main__":
            for value in vars(obj).values():
                fix(getattr(value, "__func__", value))

    fix(fn)


def _call_train_fn(fn: Callable[..., Any], config: dict | None) -> Any:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if config is None and not params:
        return fn()
    if config is None:
        return fn({}) if len(params) == 1 else fn()
    return fn(config)


def _say_in_output() -> None:
    """outlast's lines about this rank (where its restore came from, what it skipped) go to the rank's
    output, beside the user's; a handler of the user's own takes them instead."""
    import logging
    import sys

    log = logging.getLogger("outlast.worker")
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("outlast %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def run(req: m.ForkWorker) -> int:
    mark("worker.run", attempt=req.attempt, rank=req.spec.rank)
    become_clean_process(worker_env(os.environ, req.env), req.cwd, req.sys_path)
    follow_cpu_share(req.threads)
    spec = req.spec
    os.environ.update({
        "RANK": str(spec.rank), "WORLD_SIZE": str(spec.world_size), "LOCAL_RANK": str(spec.local_rank),
        "LOCAL_WORLD_SIZE": str(spec.local_world_size), "NODE_RANK": str(spec.node_rank),
        "OUTLAST_ATTEMPT": str(req.attempt), "OUTLAST_ERROR_FILE": req.error_file, "OUTLAST_NODE_ID": req.node_id,
    })

    from outlast.train import _session, positions
    from outlast.train.context import TrainContext

    _say_in_output()

    ctx = zmq.Context()
    identity = worker_identity(req.attempt, spec.rank, incarnation_from_env())
    sock = connect_dealer(ctx, req.controller_address, identity, key=worker_key())
    phase = "setup"
    code = 1
    backend = None
    try:
        payload: WorkerPayload = cloudpickle.loads(req.payload)
        backend = payload.backend
        if payload.main_file:
            restore_source_filenames(payload.train_fn, payload.main_file)
        # A rank forked into a live group that a shrink numbered afresh holds another rank there than its name.
        world_rank, world_size = live_group_rank_from_env() or (spec.rank, spec.world_size)
        context = TrainContext(
            world_rank=world_rank, world_size=world_size, local_rank=spec.local_rank,
            local_world_size=spec.local_world_size, node_rank=spec.node_rank, experiment_name=req.run_name,
            attempt=req.attempt, storage_path=payload.storage.uri(payload.run_dir),
        )
        session = _session.WorkerSession(context, sock, payload.storage, payload.run_dir, req.restore_checkpoint,
                                          controller_address=req.controller_address, spawned_rank=spec.rank)
        _session.set_session(session)
        positions.start(session.saved_data_positions)
        session.hello(os.getpid())
        mark("worker.hello", attempt=req.attempt, rank=spec.rank)
        watch.start(req.attempt, spec.rank, req.controller_address, session.progress)  # progress; stacks on a hang
        backend.on_start(context)
        session.set_up()
        mark("worker.rendezvous", attempt=req.attempt, rank=spec.rank)
        phase = "train"
        returned = _call_train_fn(payload.train_fn, payload.train_loop_config)
        phase = "shutdown"
        backend.on_shutdown()
        session.done(returned)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code != 0:
            _write_error(req.error_file, e, phase)
    except BaseException as e:
        _write_error(req.error_file, e, phase)  # the controller logs it with the failure
        code = 1
    finally:
        sock.close(linger=2000)  # the last reports and WorkerDone must reach the controller
        ctx.term()
    return code
