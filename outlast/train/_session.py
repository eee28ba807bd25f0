"""The worker side of a run: report, checkpoints and collectives over one socket.

A report without a checkpoint is a send and nothing else. A report with one uploads
this rank's files, then waits for the controller to say the checkpoint is committed,
so that once `report()` has returned on every rank, a failure restores it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import zmq

from outlast.faults import fault_point
from outlast.protocol import messages as m
from outlast.protocol.messages import ALLGATHER, read_gathered
from outlast.protocol.transport import TO_WORKER, encode
from outlast.storage import naming
from outlast.storage.base import Storage, StorageError
from outlast.storage.checksum import hash_file
from outlast.storage.local import walk_files
from outlast.storage.records import MANIFEST_NAME, MAX_SMALL_DOCUMENT_BYTES, DocumentTooLarge
from outlast.storage.run_store import RunStore, read_document
from outlast.storage.tier_restore import restore
from outlast.train import positions
from outlast.train.fetch_progress import reporting_fetch
from outlast.train._uploads import Uploads, dir_bytes, local_files
from outlast.train.checkpoint import Checkpoint, CheckpointUploadMode, ReportedCheckpoint
from outlast.train.context import TrainContext
from outlast.train.metric_types import check_metrics
from outlast.train.preemption import PreemptionInfo
from outlast.train.session_core import SessionCore, Step
from outlast.errors import NotInWorkerError
from outlast.trace import mark

log = logging.getLogger("outlast.worker")

_WAIT_LOG_INTERVAL_S = float(os.environ.get("OUTLAST_COLLECTIVE_WARN_INTERVAL_S", "60"))
_MARKER_GRACE_S = 5.0


class WorkerSession:
    """Drives the protocol's core (`session_core.SessionCore`) over the rank's socket, blocking where a call
    waits, and does what has files: uploads, the restore, the return value."""

    def __init__(
        self,
        context: TrainContext,
        sock: zmq.Socket,
        storage: Storage,
        run_dir: str,
        restore_checkpoint: str | None,
        controller_address: str = "",
        cache_root: Path | None = None,
        spawned_rank: int | None = None,
    ) -> None:
        self.context = context
        # The rank the controller spawned this process as, which every message to it names. The same as
        # context.world_rank, but in a live group that a shrink numbered afresh (get_context() tells the group's).
        self.spawned_rank = context.world_rank if spawned_rank is None else spawned_rank
        self._sock = sock
        self._storage = storage
        self._run_dir = run_dir
        self._restore = restore_checkpoint
        self._restored: Checkpoint | None = None
        self._cache_root = cache_root
        self._controller_address = controller_address
        self._core = SessionCore(context.attempt, self.spawned_rank)
        self._preemption: PreemptionInfo | None = None
        self._uploads = Uploads(storage, controller_address, context.attempt, self.spawned_rank)
        self._relaxed = os.environ.get("OUTLAST_RELAX_COLLECTIVES") == "1"
        self._memory_only = os.environ.get("OUTLAST_CHECKPOINT_STORAGE") == "memory"

    def in_live_generation(self, generation: int) -> None:
        """Live recovery: the rank's live group formed `generation`; its reports from here say so."""
        self._core.generation = generation

    def progress(self) -> int:
        """Calls into outlast so far, each one progress (read by the watch thread, `watch.py`)."""
        return self._core.progress()

    def heartbeat(self) -> None:
        self._core.heartbeats += 1

    @property
    def reports_made(self) -> int:
        return self._core.reports

    def continue_reports(self, count: int) -> None:
        """Live recovery: a replacement's reports go on from the count of the rank whose state it took, so that
        its report of a step has the index the other ranks' reports of that step have."""
        self._core.reports = count

    def hello(self, pid: int) -> None:
        self._send(self._core.hello(pid))
        self._run(self._core.welcome(time.monotonic()))

    def set_up(self) -> None:
        """The backend is set up: a failure before this was outlast's own set-up's."""
        self._run(self._core.set_up(time.monotonic()))

    # -- reports and checkpoints ------------------------------------------------

    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None = None,
               upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC,
               delete_local_after_upload: bool | None = None, dir_name: str | None = None,
               write: Callable[[Path], None] | None = None) -> None:
        """`write(dir)`: a staged save; the files are written into a directory of outlast's,
        off the training thread, then uploaded (ASYNC)."""
        fault_point("report.begin")
        if checkpoint is None and write is None:
            self._report(metrics)
            return
        began = time.monotonic()
        try:
            self._report(metrics, checkpoint, upload_mode, delete_local_after_upload, dir_name, write)
        finally:
            # The loop's checkpoint stall, sent with the next report (the run's goodput, docs/guide/watching.md).
            self._core.stalled_s = time.monotonic() - began

    def _report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None = None,
                upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC,
                delete_local_after_upload: bool | None = None, dir_name: str | None = None,
                write: Callable[[Path], None] | None = None) -> None:
        check_metrics(metrics)
        name = naming.check_name(dir_name) if dir_name is not None else None
        upload_mode = CheckpointUploadMode(upload_mode)
        if name is not None and not self._memory_only and (checkpoint is not None or write is not None):
            self._claim(name, self._core.reports)  # before the report counts: a clash loses nothing
        position = positions.document(self.context.world_size, self.context.world_rank)
        slot = self._core.begin_report(name)
        if self._core.reports == 1:
            mark("worker.first_report", attempt=self.context.attempt, rank=self.context.world_rank)
        if checkpoint is None and write is None:
            self._run(self._core.report(slot, metrics, data_position=position))
            return
        dest = f"{self._run_dir}/{slot.name}"
        nbytes = dir_bytes(checkpoint.path) if checkpoint is not None else 0
        if self._memory_only or (slot.saw_preemption and self._core.through_peer):
            # A notice's checkpoint through a peer is committed once in memory on two nodes, and uploaded from
            # there afterwards: the deadline never waits on storage.
            self._report_in_memory(slot, metrics, checkpoint, write, nbytes,
                                   delete=bool(delete_local_after_upload) or write is not None,
                                   in_memory=not self._memory_only, position=position)
            return
        if write is not None or upload_mode is CheckpointUploadMode.ASYNC:
            delete = True if delete_local_after_upload is None or write is not None else delete_local_after_upload
            if slot.waits_for_uploads:
                self._uploads.wait()  # before the Report
            self._run(self._core.report(slot, metrics, data_position=position, checkpoint=True,
                                        upload_bytes=nbytes, bandwidth_bps=self._uploads.bandwidth_bps,
                                        upload_files=local_files(checkpoint.path) if write is None else None))
            self._uploads.start(slot.index, slot.name, dest, delete, urgent=slot.saw_preemption,
                                local_dir=checkpoint.path if checkpoint is not None else None, write=write)
            return
        mark("report.upload_begin", rank=self.spawned_rank, index=slot.index)
        files = self._uploads.upload(checkpoint.path, dest, move=bool(delete_local_after_upload),
                                     urgent=slot.saw_preemption)
        mark("report.uploaded", rank=self.spawned_rank, index=slot.index)
        fault_point("report.after_upload")
        if delete_local_after_upload:
            shutil.rmtree(checkpoint.path, ignore_errors=True)
        # This node's memory tier copies the files from storage's own directory where storage is a file system
        # (it stays, so the commit does not wait for the copy), else from the rank's, where they stay until the
        # commit, which then waits for the copy.
        stored = self._storage.local_path(dest)
        here = "" if delete_local_after_upload else str(stored) if stored is not None \
            else os.path.abspath(checkpoint.path)
        self._run(self._core.report(slot, metrics, data_position=position, checkpoint=True, files=files,
                                    upload_bytes=nbytes, bandwidth_bps=self._uploads.bandwidth_bps,
                                    now=time.monotonic(), local_dir=here, local_dir_stored=stored is not None))
        mark("report.committed", rank=self.spawned_rank, index=slot.index)
        fault_point("report.after_commit")

    def _claim(self, name: str, index: int) -> None:
        """Mark `name`'s directory as the checkpoint of report `index` before any file goes there, or raise
        `CheckpointNameError` when it holds something else."""
        dest = f"{self._run_dir}/{name}"
        marker = f"{dest}/{naming.MARKER_NAME}"
        found = None
        occupied = self._storage.exists(dest)
        if occupied:
            # Another rank of this report may have made the directory a moment ago, its marker still on the
            # way (a file system makes the directory before the marker's rename lands in it): give it time
            # before taking the directory for one of the user's own.
            deadline = time.monotonic() + _MARKER_GRACE_S
            while True:
                try:
                    found = naming.decode_marker(read_document(self._storage, marker, MAX_SMALL_DOCUMENT_BYTES))
                except (FileNotFoundError, DocumentTooLarge):
                    found = None
                if found is not None or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        committed = found is not None and self._storage.exists(f"{dest}/{MANIFEST_NAME}")
        problem = naming.clash(name, self._storage.uri(dest), self.context.attempt, index, found, committed, occupied)
        if problem is not None:
            raise naming.CheckpointNameError(problem)
        if found is None:
            self._storage.write_atomic(marker, naming.encode_marker(self.context.attempt, index))

    def _report_in_memory(self, slot, metrics: dict[str, Any], checkpoint: Checkpoint | None,
                          write: Callable[[Path], None] | None, nbytes: int, delete: bool,
                          in_memory: bool = False, position: str = "") -> None:
        """CheckpointConfig(checkpoint_storage="memory"): nothing is uploaded; the files are listed and checked
        here, and the commit waits until two nodes keep them in memory. A staged save is written first."""
        local = checkpoint.path if checkpoint is not None else tempfile.mkdtemp(prefix=f"outlast-staged-{slot.name}-")
        try:
            if write is not None:
                write(Path(local))
            files = local_entries(Path(local))
            self._run(self._core.report(slot, metrics, data_position=position, checkpoint=True, files=files,
                                        upload_bytes=nbytes, now=time.monotonic(), local_dir=os.path.abspath(local),
                                        in_memory=in_memory))
        finally:
            if delete:
                shutil.rmtree(local, ignore_errors=True)

    def wait_for_uploads(self) -> None:
        self._uploads.wait()

    def get_checkpoint(self) -> Checkpoint | None:
        """The checkpoint to restore, checked against its manifest: from this node's memory tier when every
        file has a whole copy there, else fetched from storage to this node once."""
        if self._restore is None:
            return None
        if self._restored is None:
            mark("worker.restore_begin", attempt=self.context.attempt, rank=self.context.world_rank)
            cache = self._cache_root or _default_cache()
            with reporting_fetch(self._storage, self._run_dir, self._restore, cache, self._controller_address,
                                 self.context.attempt, self.context.world_rank):
                replicas: list[int] = []
                path, source, passed_over = restore(self._storage, self._run_dir, self._restore, cache,
                                                    os.environ.get("OUTLAST_NODE_ID", ""), replicas=replicas)
            for why in passed_over:
                log.warning("restoring %s: %s", self._restore, why)
            log.info("rank %d restored %s from %s%s", self.context.world_rank, self._restore, source.value,
                     f" (the files of ranks {sorted(replicas)} from the replicas kept here)" if replicas else "")
            self._restored = Checkpoint(path)
            mark("worker.restored", attempt=self.context.attempt, rank=self.context.world_rank, source=source.value)
        return self._restored

    def saved_data_positions(self) -> dict[int, str]:
        """rank -> the data position that rank saved with the checkpoint this attempt restores (empty: none)."""
        if self._restore is None:
            return {}
        manifest = RunStore(self._storage, self._run_dir).read_manifest(self._restore)
        return dict(manifest.data_positions) if manifest is not None else {}

    # -- preemption -------------------------------------------------------------

    def get_preemption_info(self) -> PreemptionInfo | None:
        notice = self._run(self._core.preemption_call(time.monotonic()))
        if notice is None:
            return None
        if self._preemption is None:
            self._preemption = PreemptionInfo(
                node_ids=list(notice.node_ids), ranks=list(notice.ranks), deadline_ms=notice.deadline_unix_ms,
                reason=notice.reason, message=notice.message,
                preempted_node_to_ranks={k: list(v) for k, v in notice.node_to_ranks.items()})
        return self._preemption

    # -- collectives ------------------------------------------------------------

    def collective(self, op: str, obj: Any = None) -> Any:
        # With relaxed collectives any rank may be the source (the lowest that survives), so all send.
        source = self.context.world_rank == 0 or self._relaxed
        payload = cloudpickle.dumps(obj) if (op == "broadcast" and source) or op == ALLGATHER else None
        reply = self._run(self._core.collective(op, payload, time.monotonic()))
        if op == "broadcast":
            return cloudpickle.loads(reply) if reply is not None else None
        if op == ALLGATHER:
            return {rank: cloudpickle.loads(data) for rank, data in sorted(read_gathered(reply).items())}
        return None

    # -- end of the train function ------------------------------------------------

    def get_all_reported_checkpoints(self) -> list[ReportedCheckpoint]:
        """The run's committed checkpoints that are still kept, with their metrics, ordered as Ray orders
        them: by CheckpointConfig's score, the best last (report order without a score)."""
        from outlast.train.result import rank_checkpoints

        self.wait_for_uploads()  # their UploadDone reaches the controller before the question does
        kept = self._run(self._core.kept_checkpoints(time.monotonic()))
        order, _, attribute = os.environ.get("OUTLAST_CHECKPOINT_SCORE", "").partition(":")
        records = rank_checkpoints(kept, None, attribute or None, order or "max")
        return [ReportedCheckpoint(Checkpoint(self._storage.uri(f"{self._run_dir}/{c.checkpoint_dir}")),
                                   dict(c.metrics)) for c in records]

    def done(self, return_value: Any = None) -> None:
        if self.context.world_rank == 0:
            self._save_return_value(return_value)
        self._uploads.close()
        self._run(self._core.done())

    def _save_return_value(self, value: Any) -> None:
        """The finishing attempt's value, or none: a failed attempt's rank 0 may have stored one before.

        Sealed with the run's credential, so that only this run's driver unpickles it (train/return_value.py)."""
        from outlast.protocol.run_credential import RunCredential
        from outlast.storage.records import MAX_DOCUMENT_BYTES, RETURN_VALUE_NAME
        from outlast.train import return_value

        path = f"{self._run_dir}/{RETURN_VALUE_NAME}"
        data = None
        credential = RunCredential.from_env()
        if value is not None and credential is None:
            log.warning("this worker holds no run credential to seal its return value with (its node was started by "
                        "an older driver); Result.return_value will be None")
        elif value is not None:
            try:
                pickled = cloudpickle.dumps(value)
            except Exception as e:
                log.warning("the train function's return value cannot be pickled (%s); Result.return_value will be "
                            "None", e)
            else:
                if len(pickled) > MAX_DOCUMENT_BYTES - 128:
                    log.warning("the train function's return value pickles to %d bytes, more than the %d kept; "
                                "Result.return_value will be None: save large results to a file or a checkpoint",
                                len(pickled), MAX_DOCUMENT_BYTES - 128)
                else:
                    data = return_value.seal(pickled, return_value.key_from_secret(credential.secret))
        try:
            if data is not None:
                self._storage.write_atomic(path, data)
            else:
                self._storage.delete(path)
        except (OSError, StorageError) as e:
            # The training is done and committed: losing the return value must not fail the run.
            log.warning("could not store the train function's return value (%s); Result.return_value may be "
                        "None or an earlier attempt's", e)

    # -- plumbing ---------------------------------------------------------------

    def _send(self, msg: m.Msg) -> None:
        self._sock.send(encode(msg))

    def _run(self, step: Step) -> Any:
        """Send what the step says, then wait for the reply it names, logging a long wait."""
        for msg in step.send:
            self._send(msg)
        if step.waiting is None:
            return step.result()
        what = step.waiting
        started = time.monotonic()
        next_log = started + _WAIT_LOG_INTERVAL_S
        while True:
            if self._sock.poll(1000):
                done = self._core.receive(TO_WORKER.decode(self._sock.recv()), time.monotonic())
                if done is not None:
                    return self._run(done)
            now = time.monotonic()
            if now >= next_log:
                log.warning("rank %d still waiting for %s after %.0f s", self.context.world_rank, what, now - started)
                next_log = now + _WAIT_LOG_INTERVAL_S


def _default_cache() -> Path:
    from outlast.statedir import private_subdir

    return private_subdir("checkpoint_cache")  # 0700 even in a 0755 $OUTLAST_HOME


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


def local_entries(local_dir: Path) -> list[m.FileEntry]:
    """The files under `local_dir` as a manifest lists them, without a copy anywhere."""
    out = []
    for rel in walk_files(local_dir)[0]:
        size, digest = hash_file(local_dir / rel)
        out.append(m.FileEntry(path=rel, size=size, xxh3_128=digest))
    return out

