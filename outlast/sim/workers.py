"""Simulated training workers: the loop as a generator, driving the worker session's real protocol core.

A rank's loop yields what it waits for: ("sleep", s), ("barrier", step) for the step's
allreduce (ranks of an attempt move in lockstep, as DDP does), or ("reply", None) for an
answer from the controller. Its `get_preemption_info()` and `report()` calls go to the same
`SessionCore` (`outlast/train/session_core.py`) that `outlast/train/_session.py` drives:
what is simulated here is the loop, the files and the time, not the protocol.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Generator

from outlast.protocol import messages as m
from outlast.protocol.kinds import FailureKind
from outlast.protocol.transport import INCARNATION_VAR
from outlast.storage.records import CorruptDocument
from outlast.sim.live import LiveSide, loop as live_loop
from outlast.sim.tier import COPY_BYTES, check
from outlast.storage.run_store import RunStore
from outlast.storage.tier_restore import choose_copies
from outlast.train.session_core import SessionCore, Step

if TYPE_CHECKING:
    from outlast.sim.cluster import NodeModel
    from outlast.sim.run import Sim

PEER_LOSS = "RuntimeError", "[/gloo/transport/tcp/pair.cc] Connection closed by peer"
UPLOAD_BYTES = 100_000_000  # what an asynchronous upload says it carries: the controller's estimate runs on it


class WorkerFailed(Exception):
    def __init__(self, exc_type: str, message: str, kind: FailureKind | None = None) -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.kind = kind  # outlast's own kind of it, as the real worker names it (`worker_main.py`)


class Gang:
    """The ranks of one attempt on one driver: an allreduce completes when every rank has reached it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.arrived: dict[int, list["SimRank"]] = {}
        self.broken = False

    def arrive(self, rank: "SimRank", step: int) -> None:
        if self.broken:
            rank.fail_later(*PEER_LOSS)
            return
        waiting = self.arrived.setdefault(step, [])
        waiting.append(rank)
        if len(waiting) == self.size:
            del self.arrived[step]
            for r in waiting:
                r.resume(None)

    def break_(self) -> None:
        """A rank died: its peers' collectives fail (gloo reports the closed connection)."""
        if self.broken:
            return
        self.broken = True
        for waiting in self.arrived.values():
            for r in waiting:
                r.fail_later(*PEER_LOSS)
        self.arrived.clear()


class SimRank:
    def __init__(self, sim: "Sim", node: "NodeModel", spawn: m.SpawnWorkers, spec: m.WorkerSpec, gang: Gang,
                 to_controller, uploads_to_controller) -> None:
        self.sim, self.node, self.spawn, self.gang = sim, node, spawn, gang
        self.rank, self.attempt, self.run_id = spec.rank, spawn.attempt, spawn.run_id
        self.world_size = spec.world_size  # the attempt's: an elastic run's differs from attempt to attempt
        self.pid = 0  # the fork server's, where the node has one
        self.to_controller = to_controller  # the session's socket
        self.uploads_to_controller = uploads_to_controller  # the upload thread's own socket
        self._upload_done_at = 0.0
        self._last_bps = 0.0  # measured on the previous upload, as a real rank's is
        self.alive = True
        self.loop = sim.schedule.loop
        self._gen: Generator | None = None
        self.core = SessionCore(self.attempt, self.rank)
        self._waiting = False
        self.where = "start (sim)"  # what its stack would show
        self.wedged = False  # a "hang" fault: it never comes back from where it is
        self.unkillable_until = 0.0  # stuck in the kernel until then: no signal ends it before
        self.children: set[int] = set()  # live processes it started, in its process group
        self._resumes = 0
        self._sent_at = float("-inf")
        self.incarnation = int(spawn.env.get(INCARNATION_VAR, "0"))  # live recovery's: the rank's replacements count
        self.live: LiveSide | None = None  # live recovery's side of the rank (`outlast/sim/live.py`)
        if sim.schedule.live and sim.driver is not None and sim.driver.live is not None:
            self.live = LiveSide(self, sim.driver.live)
            sim.live_processes[(self.run_id, self.attempt, self.rank, self.incarnation)] = self
            sim.live_watch.started(self)

    # ---- running the generator ----------------------------------------------------------

    def start(self) -> None:
        self._send(self.core.hello(0, set_up=True))  # a simulated rank has no process group to meet
        self.children = {self.sim.new_pid() for _ in range(self.loop.children)}
        self.sim.facts["children_started"] += len(self.children)
        self._gen = self._main()
        self.resume(None)

    def resume(self, value) -> None:
        if not self.alive or self._gen is None or self.wedged:
            return
        self._note_progress()
        try:
            req = self._gen.send(value)
        except StopIteration:
            # done(): the uploads in flight end first, then WorkerDone, then the process exits.
            self.sim.world.after(max(0.0, self._upload_done_at - self.sim.world.now), self._exit_done)
            return
        except SystemExit as e:  # as worker_main.py takes it: no WorkerDone, the process's exit code alone
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            self.sim.live_watch.exited(self, code)
            self.exit_process()
            self.node.worker_exited(self, code, None, None if code == 0 else m.WorkerError(
                exc_type="SystemExit", message=str(e.code), traceback="", phase="train"))
            return
        except WorkerFailed as e:
            self.exit_process()
            self.node.worker_exited(self, 1, None, m.WorkerError(exc_type=e.exc_type, kind=e.kind, message=str(e),
                                                                  traceback="", phase="train"))
            return
        kind, arg = req
        self.where = {"sleep": "train_step (sim)", "barrier": "all_reduce (sim)"}.get(kind, "_wait_for (sim)")
        if kind == "sleep":
            self.sim.world.after(arg, self.resume, None)
        elif kind == "barrier":
            self.gang.arrive(self, arg)
        elif kind == "die":  # a fault armed for this point of a live step
            self.sim.world.after(0.0, self.sim.live_kill, self, arg)
        else:
            self._waiting = True

    def _exit_done(self) -> None:
        if not self.alive or self.wedged:
            return
        if not (self.loop.done_lost and self.rank == 0):
            self._sends(self.core.done())
        self.exit_process()
        self.node.worker_exited(self, 0, None, None)

    def exit_process(self) -> None:
        """With `exit_loses_messages`, what the upload thread's socket still holds never arrives: its context
        is never terminated, so nothing lingers for it at the exit (the training socket's does, `worker_main.py`)."""
        if self.live is not None:
            self.sim.live_died(self)  # its sockets close with it
        if self.loop.exit_loses_messages:
            self.sim.facts["uploads_lost_at_exit"] += self.uploads_to_controller.lose_pending()

    def fail_later(self, exc_type: str, message: str) -> None:
        def fail() -> None:
            if self.alive and self._gen is not None:
                try:
                    self._gen.throw(WorkerFailed(exc_type, message))
                except (WorkerFailed, StopIteration):
                    pass
                self.exit_process()
                self.node.worker_exited(self, 1, None, m.WorkerError(exc_type=exc_type, message=message,
                                                                      traceback="", phase="train"))
        self.sim.world.after(0.01, fail)

    def kill(self) -> None:
        self.alive = False
        if self._gen is not None:
            self._gen.close()
        self.gang.break_()
        if self.live is not None:
            self.sim.live_died(self)

    def on_message(self, msg: m.Msg) -> None:
        if self.alive and isinstance(msg, m.DumpStacks):  # its watch thread answers, wherever the loop is
            self._send(m.StackDump(attempt=self.attempt, rank=self.rank, where=self.where,
                                   text=f"Current thread 0x{self.rank:x} (most recent call first):\n"
                                        f"  File \"sim.py\", line 1 in {self.where}\n"))
        elif self.alive:
            step = self.core.receive(msg, self.sim.world.now)
            if step is not None:
                self._waiting = False
                self.resume(step)

    def wedge(self) -> None:
        """From its next step on, it sleeps forever in user code (its peers wait for it in all_reduce)."""
        self.wedged = True
        self.where = "sleep_forever (sim user code)"

    def _note_progress(self) -> None:
        """As its watch thread would: every time the loop moves on is progress, sent at most once a second."""
        if self.sim.schedule.hang_timeout_s == float("inf"):
            return  # the random schedules run without it, as they always did
        self._resumes += 1
        if self.sim.world.now - self._sent_at >= 1.0:
            self._sent_at = self.sim.world.now
            self._send(m.Progress(attempt=self.attempt, rank=self.rank, count=self._resumes))

    def _send(self, msg: m.WorkerMessage) -> None:
        self.to_controller(msg)

    def _sends(self, step: Step) -> None:
        for msg in step.send:
            self._send(msg)

    def _call(self, step: Step) -> Generator:
        """Drive one call of the session's core: send, wait for the reply it names, return its value."""
        self._sends(step)
        while step.waiting is not None:
            step = yield "reply", None
            self._sends(step)
        if step.error is not None:
            self.sim.observer.call_failed(self, step.error)
            raise WorkerFailed(type(step.error).__name__, str(step.error))
        return step.value

    # ---- the loop -------------------------------------------------------------------------

    def _main(self) -> Generator:
        loop, rng = self.loop, self.sim.world.rng
        step = self._restore()
        if self.live is not None:
            yield from live_loop(self, step)
            return
        saved_on_notice = False
        while step < loop.steps:
            yield "sleep", loop.step_s * rng.uniform(0.9, 1.1)
            yield "barrier", step
            info = (yield from self._preemption_call()) if loop.asks else None
            if info is not None and loop.jit and not saved_on_notice:
                yield from self._report(step, checkpoint=True)
                saved_on_notice = True
                if loop.return_on_notice:
                    return
            elif (step + 1) % loop.report_every == 0:
                every = loop.report_every * loop.checkpoint_every
                yield from self._report(step, checkpoint=(step + 1) % every == 0)
            step += 1

    def _restore(self) -> int:
        name = self.spawn.restore_checkpoint
        if name is None:
            return 0
        store = RunStore(self.sim.storage, "run")
        try:
            manifest = store.read_manifest(name)
        except (OSError, CorruptDocument) as e:
            raise WorkerFailed(type(e).__name__, f"could not read checkpoint {name}: {e}") from None
        finally:
            self.sim.storage.take_spent()
        if manifest is None:
            raise WorkerFailed("CorruptCheckpointError", f"checkpoint {name} has no manifest",
                               FailureKind.CORRUPT_CHECKPOINT)
        if self.sim.schedule.tier is not None:
            self._read_files(manifest)
        self.sim.observer.restored(self, name, int(manifest.metrics.get("step", -1)))
        return int(manifest.metrics.get("step", -1)) + 1

    def _preemption_call(self) -> Generator:
        index = self.core.preemption_calls
        notice = yield from self._call(self.core.preemption_call(self.sim.world.now))
        self.sim.observer.preemption_answer(self, index, notice)
        return notice

    def _report(self, step: int, checkpoint: bool) -> Generator:
        slot = self.core.begin_report()
        metrics = {"step": step}
        has_files = checkpoint and (self.loop.sharded or self.rank == 0)
        if not has_files:
            self._sends(self.core.report(slot, metrics))
            if checkpoint:
                self.sim.observer.checkpoint_part(self, slot.name, "report")
            self.sim.observer.report_returned(self, slot.index, slot.name if checkpoint else None)
            return
        data = f"{self.rank}:{step}".encode()
        path = f"rank_{self.rank}.bin"
        tier = self.sim.schedule.tier
        if tier is not None:
            yield from self._report_beside_tier(slot, metrics, step, path, tier.checkpoint_storage == "memory")
            return
        if self.loop.async_upload:
            if slot.waits_for_uploads and (wait := self._upload_done_at - self.sim.world.now) > 0:
                yield "sleep", wait
            self._upload_in_background(slot, metrics, path, data)
            return
        yield from self._upload(slot, path, data)
        entry = m.FileEntry(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        self.sim.observer.checkpoint_part(self, slot.name, "files")
        self.sim.observer.checkpoint_part(self, slot.name, "report")
        yield from self._call(self.core.report(slot, metrics, checkpoint=True, files=[entry], now=self.sim.world.now))
        self.sim.observer.report_returned(self, slot.index, slot.name)

    def _upload_in_background(self, slot, metrics: dict, path: str, data: bytes) -> None:
        """An ASYNC report: its upload says when it is done, as the upload thread does."""
        self._sends(self.core.report(slot, metrics, checkpoint=True, upload_bytes=UPLOAD_BYTES,
                                     bandwidth_bps=self._last_bps,
                                     upload_files=[m.FileEntry(path=path, size=len(data))]))
        self.sim.observer.checkpoint_part(self, slot.name, "report")
        took = self.sim.world.rng.uniform(0.0, 0.5) + self.sim.storage.latency_s
        self._last_bps = UPLOAD_BYTES / max(took, 1e-3)
        self._upload_done_at = max(self._upload_done_at, self.sim.world.now + took)
        self.sim.world.after(took, self._upload_done, slot.index, slot.name, path, data)

    def _upload(self, slot, path: str, data: bytes) -> Generator:
        """A SYNC upload in the rank's own thread; the time storage spent on it is the rank's."""
        try:
            self.sim.storage.write_atomic(f"run/{slot.name}/{path}", data)
        except OSError as e:
            raise WorkerFailed("OSError", f"upload of {slot.name} failed: {e}") from None
        finally:
            spent = self.sim.storage.take_spent()
        if spent:
            yield "sleep", spent

    def _report_beside_tier(self, slot, metrics: dict, step: int, path: str, memory_only: bool) -> Generator:
        """With memory tiers on the nodes: the rank's files stay in its directory on its node until the commit,
        which waits for its node's tier to copy them (`_session.py`); a run that keeps checkpoints in memory
        only uploads nothing, whatever its upload mode."""
        data = f"{self.rank}:{step}".encode().ljust(COPY_BYTES, b".")
        local_dir = f"/local/{self.node.node_id}/{slot.name}/rank-{self.rank}"
        self.node.local[local_dir] = {path: data}
        entry = m.FileEntry(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        self.sim.observer.wrote(self, slot.name, entry)
        if not memory_only and self.loop.async_upload:
            self._upload_in_background(slot, metrics, path, data)
            return
        if not memory_only:
            yield from self._upload(slot, path, data)
            self.sim.observer.checkpoint_part(self, slot.name, "files")
        self.sim.observer.checkpoint_part(self, slot.name, "report")
        yield from self._call(self.core.report(slot, metrics, checkpoint=True, files=[entry], now=self.sim.world.now,
                                               local_dir=local_dir))
        self.sim.observer.report_returned(self, slot.index, slot.name)

    def _read_files(self, manifest) -> None:
        """`tier_restore.restore`: every file of the checkpoint from this node's memory when each has a whole
        copy here (as `choose_copies` picks them), else from storage, each checked against the manifest."""
        name = manifest.checkpoint_dir
        tier = getattr(self.node, "tier", None)
        copies = tier.held(self.sim.storage.uri("run"), name) if tier is not None else []
        chosen, _, _ = choose_copies(manifest.files, copies, self.node.node_id, check)
        if chosen is not None:
            read = {path: where[path] for path, where in chosen.items()}
            self.sim.facts["restores_from_memory"] += 1
            self.sim.observer.read_checkpoint(self, manifest, read, "memory")
            return
        read = {}
        for entry in manifest.files:
            data = self.sim.storage.files.get(f"run/{name}/{entry.path}")
            why = check({entry.path: data} if data is not None else {}, entry)
            if why is not None:
                self.sim.observer.restore_failed(self, name, why)
                raise WorkerFailed("CorruptCheckpointError", f"checkpoint {name} cannot be restored: {why}",
                                   FailureKind.CORRUPT_CHECKPOINT)
            read[entry.path] = data
        self.sim.observer.read_checkpoint(self, manifest, read, "storage")

    def _upload_done(self, index: int, name: str, path: str, data: bytes) -> None:
        if not self.alive:
            return
        files, error = [], None
        try:
            self.sim.storage.write_atomic(f"run/{name}/{path}", data)
            files = [m.FileEntry(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest())]
            self.sim.observer.checkpoint_part(self, name, "files")
        except OSError as e:
            error = f"OSError: {e}"
        finally:
            self.sim.storage.take_spent()
        self.uploads_to_controller(m.UploadDone(attempt=self.attempt, rank=self.rank, index=index, checkpoint_dir=name,
                                                files=files, error=error))
