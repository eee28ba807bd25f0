"""The worker side of a run: report, checkpoints and collectives over one socket.

A report without a checkpoint is a send and nothing else. A report with one uploads
this rank's files, then waits for the controller to say the checkpoint is committed,
so that once `report()` has returned on every rank, a failure restores it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import cloudpickle
import tenacity
import zmq

from outlast.faults import fault_point
from outlast.protocol import messages as m
from outlast.protocol.run_credential import worker_key
from outlast.protocol.transport import TO_WORKER, connect_dealer, encode
from outlast.storage.base import Storage, StorageError
from outlast.storage.records import checkpoint_dir_name
from outlast.storage.restore import materialize
from outlast.storage.run_store import RunStore
from outlast.train.checkpoint import Checkpoint, CheckpointUploadMode, ReportedCheckpoint
from outlast.train.context import TrainContext
from outlast.train.preemption import PreemptionInfo
from outlast.errors import CheckpointCommitError, CollectiveTimeoutError, NotInWorkerError

log = logging.getLogger("outlast.worker")

_WAIT_LOG_INTERVAL_S = float(os.environ.get("OUTLAST_COLLECTIVE_WARN_INTERVAL_S", "60"))
_UPLOAD_TRIES = int(os.environ.get("OUTLAST_UPLOAD_TRIES", "4"))


def _upload_with_retries(storage: Storage, local_dir: str, dest: str, move: bool = False) -> list[m.FileEntry]:
    """A storage hiccup costs a retry with backoff, not the checkpoint."""
    retry = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(StorageError), stop=tenacity.stop_after_attempt(_UPLOAD_TRIES),
        wait=tenacity.wait_exponential(multiplier=0.2, max=5), reraise=True,
        before_sleep=lambda state: log.warning("upload to %s failed (%s); retrying", dest, state.outcome.exception()),
    )
    # `move`: the caller deletes the local files after the upload anyway, so storage on the
    # same file system may rename them into place instead of copying.
    return retry(storage.upload_dir, Path(local_dir), dest, move=move)


class WorkerSession:
    def __init__(
        self,
        context: TrainContext,
        sock: zmq.Socket,
        storage: Storage,
        run_dir: str,
        restore_checkpoint: str | None,
        controller_address: str = "",
        cache_root: Path | None = None,
    ) -> None:
        self.context = context
        self._sock = sock
        self._storage = storage
        self._run_dir = run_dir
        self._restore = restore_checkpoint
        self._restored: Checkpoint | None = None
        self._cache_root = cache_root
        self._controller_address = controller_address
        self._reports = 0
        self._collectives = 0
        self._inbox: list[m.ControllerToWorker] = []
        self._preemption_calls = 0
        self._horizon = 0  # calls below it answer None without asking anyone...
        self._expires = 0.0  # ...until then (time.monotonic())
        self._preemption: PreemptionInfo | None = None
        self._uploader: ThreadPoolExecutor | None = None
        self._upload: Future | None = None
        self._upload_sock: zmq.Socket | None = None
        self._relaxed = os.environ.get("OUTLAST_RELAX_COLLECTIVES") == "1"
        self._heartbeats = 0

    def progress(self) -> int:
        """Calls into outlast so far, each one progress (read by the watch thread, `watch.py`)."""
        return self._reports + self._preemption_calls + self._collectives + self._heartbeats

    def heartbeat(self) -> None:
        self._heartbeats += 1

    # -- reports and checkpoints ------------------------------------------------

    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None = None,
               upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC,
               delete_local_after_upload: bool | None = None, dir_name: str | None = None) -> None:
        if not isinstance(metrics, dict):
            raise TypeError(f"report(metrics=...) takes a dict, got {type(metrics).__name__}")
        if dir_name is not None:
            if not isinstance(dir_name, str) or not dir_name or "/" in dir_name:
                raise ValueError(f"report(checkpoint_dir_name=...) must be a name without '/', got {dir_name!r}")
            if checkpoint is not None:
                # outlast's own directory name is what its recovery finds checkpoints by; the name asked
                # for travels with the checkpoint's files.
                checkpoint.update_metadata({"checkpoint_dir_name": dir_name})
        upload_mode = CheckpointUploadMode(upload_mode)
        index = self._reports
        self._reports += 1
        attempt, rank = self.context.attempt, self.context.world_rank
        # Whether this checkpoint is the loop's answer to a notice: the controller waits for that one.
        saw = self._preemption is not None and self._preemption_calls > self._horizon
        if checkpoint is None:
            self._send(m.Report(attempt=attempt, rank=rank, index=index, metrics=metrics))
            return
        name = checkpoint_dir_name(attempt, index)
        dest = f"{self._run_dir}/{name}"
        if upload_mode is CheckpointUploadMode.ASYNC:
            delete = True if delete_local_after_upload is None else delete_local_after_upload
            self.wait_for_uploads()  # one upload in flight at a time keeps local disk use bounded
            self._send(m.Report(attempt=attempt, rank=rank, index=index, metrics=metrics, checkpoint_dir=name,
                                upload_pending=True, saw_preemption=saw))
            if self._uploader is None:
                self._uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outlast-upload")
            self._upload = self._uploader.submit(self._upload_async, checkpoint.path, dest, index, name, delete)
            return
        files = _upload_with_retries(self._storage, checkpoint.path, dest, move=bool(delete_local_after_upload))
        fault_point("report.after_upload")
        if delete_local_after_upload:
            shutil.rmtree(checkpoint.path, ignore_errors=True)
        self._send(
            m.Report(attempt=attempt, rank=rank, index=index, metrics=metrics, checkpoint_dir=name, files=files,
                     saw_preemption=saw)
        )
        reply = self._wait_for(
            lambda msg: isinstance(msg, (m.Committed, m.CommitFailed)) and msg.index == index,
            what=f"the commit of checkpoint {name} (report #{index})",
        )
        if isinstance(reply, m.CommitFailed):
            raise CheckpointCommitError(f"checkpoint {name} was not committed: {reply.reason}")
        fault_point("report.after_commit")

    def _upload_async(self, local_dir: str, dest: str, index: int, name: str, delete: bool) -> None:
        files, error = [], None
        try:
            files = _upload_with_retries(self._storage, local_dir, dest, move=delete)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            log.error("rank %d could not upload checkpoint %s: %s", self.context.world_rank, name, error)
        if delete and error is None:
            shutil.rmtree(local_dir, ignore_errors=True)
        done = m.UploadDone(attempt=self.context.attempt, rank=self.context.world_rank, index=index,
                            checkpoint_dir=name, files=files, error=error)
        # A ZeroMQ socket belongs to one thread: the upload thread has its own.
        if self._upload_sock is None:
            self._upload_sock = connect_dealer(zmq.Context.instance(), self._controller_address,
                                               key=worker_key())
        self._upload_sock.send(encode(done))

    def wait_for_uploads(self) -> None:
        if self._upload is not None:
            self._upload.result()
            self._upload = None

    def get_checkpoint(self) -> Checkpoint | None:
        """The checkpoint to restore, fetched to this node once and checked against its manifest."""
        if self._restore is None:
            return None
        if self._restored is None:
            path = materialize(self._storage, self._run_dir, self._restore, self._cache_root or _default_cache())
            self._restored = Checkpoint(path)
        return self._restored

    # -- preemption -------------------------------------------------------------

    def get_preemption_info(self) -> PreemptionInfo | None:
        index = self._preemption_calls
        self._preemption_calls = index + 1
        if index < self._horizon and time.monotonic() < self._expires:
            return None
        if self._preemption is not None:
            return self._preemption
        self._send(m.PreemptionQuery(attempt=self.context.attempt, rank=self.context.world_rank, index=index))
        reply = self._wait_for(
            lambda msg: isinstance(msg, (m.PreemptionGrant, m.PreemptionNotice)) and msg.index == index,
            what=f"the answer to get_preemption_info() call #{index}",
        )
        if isinstance(reply, m.PreemptionGrant):
            self._horizon, self._expires = reply.horizon, time.monotonic() + reply.valid_s
            return None
        self._preemption = PreemptionInfo(node_ids=list(reply.node_ids), ranks=list(reply.ranks),
                                          deadline_ms=reply.deadline_unix_ms, reason=reply.reason,
                                          message=reply.message,
                                          preempted_node_to_ranks={k: list(v) for k, v in reply.node_to_ranks.items()})
        self._horizon, self._expires = reply.decision_index, float("inf")
        return self._preemption if index >= reply.decision_index else None

    # -- collectives ------------------------------------------------------------

    def collective(self, op: str, obj: Any = None) -> Any:
        seq = self._collectives
        self._collectives += 1
        rank = self.context.world_rank
        # With relaxed collectives any rank may be the source (the lowest that survives), so all send.
        source = rank == 0 or self._relaxed
        payload = cloudpickle.dumps(obj) if (op == "broadcast" and source) else None
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

    def get_all_reported_checkpoints(self) -> list[ReportedCheckpoint]:
        """The run's committed checkpoints that are still kept, in report order, with their metrics."""
        self.wait_for_uploads()
        state = RunStore(self._storage, self._run_dir).load_state()
        records = sorted(state.checkpoints, key=lambda c: c.seq) if state is not None else []
        return [ReportedCheckpoint(Checkpoint(self._storage.uri(f"{self._run_dir}/{c.checkpoint_dir}")),
                                   dict(c.metrics)) for c in records]

    def done(self, return_value: Any = None) -> None:
        if return_value is not None and self.context.world_rank == 0:
            self._save_return_value(return_value)
        self.wait_for_uploads()
        if self._uploader is not None:
            self._uploader.shutdown()
        if self._upload_sock is not None:
            self._upload_sock.close(linger=2000)  # its last UploadDone must get out before we exit
        self._send(m.WorkerDone(attempt=self.context.attempt, rank=self.context.world_rank, reports=self._reports))

    def _save_return_value(self, value: Any) -> None:
        from outlast.train.result import RETURN_VALUE_NAME

        try:
            data = cloudpickle.dumps(value)
        except Exception as e:
            log.warning("the train function's return value cannot be pickled (%s); Result.return_value will be "
                        "None", e)
            return
        self._storage.write_atomic(f"{self._run_dir}/{RETURN_VALUE_NAME}", data)

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


def _default_cache() -> Path:
    from outlast.client.discovery import state_dir

    return state_dir() / "checkpoint_cache"


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
