"""The worker side of a run: report, checkpoints and collectives over one socket.

A report without a checkpoint is a send and nothing else. A report with one uploads
this rank's files, then waits for the controller to say the checkpoint is committed,
so that once `report()` has returned on every rank, a failure restores it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import cloudpickle
import zmq

from outlast.protocol import messages as m
from outlast.protocol.transport import TO_WORKER, encode
from outlast.storage.base import Storage
from outlast.storage.records import checkpoint_dir_name
from outlast.train.checkpoint import Checkpoint
from outlast.train.context import TrainContext
from outlast.train.errors import CheckpointCommitError, CollectiveTimeoutError, NotInWorkerError

log = logging.getLogger("outlast.worker")

_WAIT_LOG_INTERVAL_S = float(os.environ.get("OUTLAST_COLLECTIVE_WARN_INTERVAL_S", "60"))


class WorkerSession:
    def __init__(
        self,
        context: TrainContext,
        sock: zmq.Socket,
        storage: Storage,
        run_dir: str,
        restore_checkpoint: str | None,
    ) -> None:
        self.context = context
        self._sock = sock
        self._storage = storage
        self._run_dir = run_dir
        self._restore = restore_checkpoint
        self._reports = 0
        self._collectives = 0
        self._inbox: list[m.ControllerToWorker] = []

    # -- reports and checkpoints ------------------------------------------------

    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None = None) -> None:
        if not isinstance(metrics, dict):
            raise TypeError(f"report(metrics=...) takes a dict, got {type(metrics).__name__}")
        index = self._reports
        self._reports += 1
        attempt, rank = self.context.attempt, self.context.world_rank
        if checkpoint is None:
            self._send(m.Report(attempt=attempt, rank=rank, index=index, metrics=metrics))
            return
        name = checkpoint_dir_name(attempt, index)
        files = self._storage.upload_dir(checkpoint.path, f"{self._run_dir}/{name}")
        self._send(
            m.Report(attempt=attempt, rank=rank, index=index, metrics=metrics, checkpoint_dir=name, files=files)
        )
        reply = self._wait_for(
            lambda msg: isinstance(msg, (m.Committed, m.CommitFailed)) and msg.index == index,
            what=f"the commit of checkpoint {name} (report #{index})",
        )
        if isinstance(reply, m.CommitFailed):
            raise CheckpointCommitError(f"checkpoint {name} was not committed: {reply.reason}")

    def get_checkpoint(self) -> Checkpoint | None:
        if self._restore is None:
            return None
        return Checkpoint(self._storage.local_path(f"{self._run_dir}/{self._restore}"))

    # -- collectives ------------------------------------------------------------

    def collective(self, op: str, obj: Any = None) -> Any:
        seq = self._collectives
        self._collectives += 1
        rank = self.context.world_rank
        payload = cloudpickle.dumps(obj) if (op == "broadcast" and rank == 0) else None
        self._send(m.CollectiveRequest(attempt=self.context.attempt, rank=rank, seq=seq, op=op, payload=payload))
        reply = self._wait_for(
            lambda msg: isinstance(msg, (m.CollectiveReply, m.CollectiveTimeout)) and msg.seq == seq,
            what=f"{op} #{seq}",
        )
        if isinstance(reply, m.CollectiveTimeout):
            raise CollectiveTimeoutError(
                f"{op} #{seq} on rank {rank} timed out after {reply.waited_s:.0f} s: ranks {reply.missing_ranks} "
                "never reached it (set OUTLAST_COLLECTIVE_TIMEOUT_S to wait longer)",
                reply.missing_ranks,
            )
        if op == "broadcast":
            return cloudpickle.loads(reply.payload) if reply.payload is not None else None
        return None

    # -- end of the train function ------------------------------------------------

    def done(self) -> None:
        self._send(m.WorkerDone(attempt=self.context.attempt, rank=self.context.world_rank, reports=self._reports))

    # -- plumbing ---------------------------------------------------------------

    def _send(self, msg: m.Msg) -> None:
        self._sock.send(encode(msg))

    def _wait_for(self, match, what: str) -> m.ControllerToWorker:
        for i, msg in enumerate(self._inbox):
            if match(msg):
                return self._inbox.pop(i)
        started = time.monotonic()
        next_log = started + _WAIT_LOG_INTERVAL_S
        while True:
            if self._sock.poll(1000):
                msg = TO_WORKER.decode(self._sock.recv())
                if match(msg):
                    return msg
                self._inbox.append(msg)
            now = time.monotonic()
            if now >= next_log:
                log.warning("rank %d still waiting for %s after %.0f s", self.context.world_rank, what, now - started)
                next_log = now + _WAIT_LOG_INTERVAL_S


_session: WorkerSession | None = None


def set_session(session: WorkerSession | None) -> None:
    global _session
    _session = session


def get_session(caller: str) -> WorkerSession:
    if _session is None:
        raise NotInWorkerError(
            f"outlast.train.{caller}() was called outside a training worker; call it from inside the "
            "train function that you pass to a Trainer"
        )
    return _session
