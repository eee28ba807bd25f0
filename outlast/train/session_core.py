"""The worker side of the controller protocol, without I/O: a rank's state, a message in, messages out.

`WorkerSession` (`_session.py`) drives it over its socket, blocking where a call waits;
the simulator's ranks (`outlast/sim/workers.py`) drive the same object on a virtual clock.
Each call into outlast returns a `Step`: the messages to send, in order, and then either
the call's value (or error), or what it now waits for. A message from the controller goes
to `receive`; the reply the waiting call expects completes it (a `Step` with its value),
any other is kept for the call that will want it.

What the protocol holds (docs/architecture.md, "Preemption"):
- `get_preemption_info()` call #i asks the controller only outside its grant: below a
  granted horizon, and until the grant expires, it answers None at once. Once a notice has
  come, every call from its decision index on returns it, and none before.
- A report's index counts every report() of the attempt; a checkpoint reported after the
  notice was seen answers it (`saw_preemption`), and its upload goes first.
- A report with its files uploaded waits until the checkpoint is committed or refused.
- Collectives are numbered per rank; each waits for its reply or its timeout.

Time (`now`) is the caller's monotonic clock, an argument wherever a grant's expiry counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from outlast.errors import CheckpointCommitError, CollectiveTimeoutError
from outlast.protocol import messages as m
from outlast.storage.naming import default_name


@dataclass(frozen=True)
class Step:
    """What a call does next: send `send`, then wait for a reply (`waiting` says which) or
    return `value` (raise `error`)."""

    send: tuple[m.WorkerMessage, ...] = ()
    waiting: str | None = None
    value: Any = None
    error: Exception | None = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


@dataclass(frozen=True)
class ReportSlot:
    """A report() about to be sent: its index, its checkpoint's directory name, and whether it
    answers a notice the loop has seen."""

    index: int
    name: str
    saw_preemption: bool

    @property
    def waits_for_uploads(self) -> bool:
        """One background upload at a time, bar the checkpoint that answers a notice: it starts at once."""
        return not self.saw_preemption


@dataclass
class _Waiting:
    match: Callable[[m.ControllerToWorker], bool]
    complete: Callable[[Any, float], Step]
    what: str


class SessionCore:
    def __init__(self, attempt: int, rank: int) -> None:
        self.attempt, self.rank = attempt, rank
        self.reports = 0
        self.generation = 0  # the live group's generation this rank is in (live recovery), sent with each report
        self.stalled_s = 0.0  # the previous report() call's seconds, when it had a checkpoint: sent with the next
        self.collectives = 0
        self.preemption_calls = 0
        self.heartbeats = 0
        self.horizon = 0  # calls below it answer None without asking anyone...
        self.expires = 0.0  # ...until then
        self.notice: m.PreemptionNotice | None = None
        self._inbox: list[m.ControllerToWorker] = []
        self._waiting: _Waiting | None = None

    def progress(self) -> int:
        """Calls into outlast so far, each one progress (what the watch thread sends)."""
        return self.reports + self.preemption_calls + self.collectives + self.heartbeats

    @property
    def waiting_for(self) -> str | None:
        return self._waiting.what if self._waiting is not None else None

    def hello(self, pid: int, set_up: bool = False) -> m.WorkerHello:
        return m.WorkerHello(attempt=self.attempt, rank=self.rank, pid=pid, set_up=set_up)

    def welcome(self, now: float = 0.0) -> Step:
        """Wait until the controller has heard the hello (`m.Welcome`): from then on, a death is known to have
        come after it."""
        return self._ask(None, lambda r: isinstance(r, m.Welcome), lambda r, at: Step(), "the controller's welcome",
                         now)

    def set_up(self, now: float = 0.0) -> Step:
        """Say the set-up is done, and wait until the controller has heard it (`m.SetUpHeard`)."""
        return self._ask(m.SetUp(attempt=self.attempt, rank=self.rank), lambda r: isinstance(r, m.SetUpHeard),
                         lambda r, at: Step(), "the controller to hear the set-up", now)

    # -- messages in --------------------------------------------------------------

    def receive(self, msg: m.ControllerToWorker, now: float) -> Step | None:
        """The waiting call's reply completes it (its `Step`); any other message is kept for later."""
        w = self._waiting
        if w is not None and w.match(msg):
            self._waiting = None
            return w.complete(msg, now)
        self._inbox.append(msg)
        return None

    def _ask(self, msg: m.WorkerMessage | None, match, complete, what: str, now: float) -> Step:
        for i, kept in enumerate(self._inbox):
            if match(kept):
                del self._inbox[i]
                return replace(complete(kept, now), send=(msg,) if msg is not None else ())
        self._waiting = _Waiting(match, complete, what)
        return Step(send=(msg,) if msg is not None else (), waiting=what)

    # -- preemption -----------------------------------------------------------------

    def preemption_call(self, now: float) -> Step:
        """A `get_preemption_info()` call; its value is the notice (a `PreemptionNotice`) or None."""
        index = self.preemption_calls
        self.preemption_calls = index + 1
        if index < self.horizon and now < self.expires:
            return Step()
        if self.notice is not None:
            return Step(value=self.notice)

        def complete(reply: m.PreemptionGrant | m.PreemptionNotice, at: float) -> Step:
            if isinstance(reply, m.PreemptionGrant):
                self.horizon, self.expires = reply.horizon, at + reply.valid_s
                return Step()
            self.notice = reply
            self.horizon, self.expires = reply.decision_index, float("inf")
            return Step(value=reply if index >= reply.decision_index else None)

        return self._ask(m.PreemptionQuery(attempt=self.attempt, rank=self.rank, index=index),
                         lambda msg: isinstance(msg, (m.PreemptionGrant, m.PreemptionNotice)) and msg.index == index,
                         complete, f"the answer to get_preemption_info() call #{index}", now)

    @property
    def through_peer(self) -> bool:
        """Whether what the loop saves now answers a notice whose checkpoint goes to a peer's memory first."""
        return self.saw_preemption and self.notice is not None and self.notice.through_peer

    @property
    def saw_preemption(self) -> bool:
        """Whether the loop has been handed the notice: what it saves from now on answers it."""
        return self.notice is not None and self.preemption_calls > self.horizon

    # -- reports --------------------------------------------------------------------

    def begin_report(self, name: str | None = None) -> ReportSlot:
        """`name`: the checkpoint directory asked for (checked already), else outlast's own."""
        index = self.reports
        self.reports += 1
        return ReportSlot(index, name or default_name(self.attempt, index), self.saw_preemption)

    def report(self, slot: ReportSlot, metrics: dict[str, Any], checkpoint: bool = False,
               files: list[m.FileEntry] | None = None, upload_bytes: int = 0, bandwidth_bps: float = 0.0,
               now: float = 0.0, upload_files: list[m.FileEntry] | None = None, local_dir: str = "",
               in_memory: bool = False, data_position: str = "", local_dir_stored: bool = False) -> Step:
        """The report's message. A checkpoint with `files` (uploaded in the calling thread) waits for its
        commit; one without them (`files=None`) is pending: its upload says when it is done, and
        `upload_files` are the files it begins with (paths and sizes), when they are known already;
        `data_position` is where the rank is in its data (`positions.document`)."""
        base = dict(attempt=self.attempt, rank=self.rank, index=slot.index, metrics=metrics, stalled_s=self.stalled_s,
                    data_position=data_position, generation=self.generation)
        self.stalled_s = 0.0
        if not checkpoint:
            return Step(send=(m.Report(**base),))
        if files is None:
            return Step(send=(m.Report(**base, checkpoint_dir=slot.name, upload_pending=True,
                                       saw_preemption=slot.saw_preemption, upload_bytes=upload_bytes,
                                       upload_bandwidth_bps=bandwidth_bps, upload_files=list(upload_files or [])),))

        def complete(reply: m.Committed | m.CommitFailed, at: float) -> Step:
            if isinstance(reply, m.CommitFailed):
                return Step(error=CheckpointCommitError(f"checkpoint {slot.name} was not committed: {reply.reason}"))
            return Step()

        msg = m.Report(**base, checkpoint_dir=slot.name, files=files, saw_preemption=slot.saw_preemption,
                       upload_bytes=upload_bytes, upload_bandwidth_bps=bandwidth_bps, local_dir=local_dir,
                       in_memory=in_memory, local_dir_stored=local_dir_stored)
        return self._ask(msg, lambda r: isinstance(r, (m.Committed, m.CommitFailed)) and r.index == slot.index,
                         complete, f"the commit of checkpoint {slot.name} (report #{slot.index})", now)

    # -- collectives ------------------------------------------------------------------

    def collective(self, op: str, payload: bytes | None, now: float = 0.0) -> Step:
        """Its value is the reply's payload (a broadcast's pickled object, or None)."""
        seq = self.collectives
        self.collectives += 1

        def complete(reply: m.CollectiveReply | m.CollectiveTimeout, at: float) -> Step:
            if isinstance(reply, m.CollectiveTimeout):
                return Step(error=CollectiveTimeoutError(
                    f"{op} #{seq} on rank {self.rank} timed out after {reply.waited_s:.0f} s: ranks "
                    f"{reply.missing_ranks} never reached it (set OUTLAST_COLLECTIVE_TIMEOUT_S to wait longer)",
                    reply.missing_ranks))
            return Step(value=reply.payload)

        return self._ask(m.CollectiveRequest(attempt=self.attempt, rank=self.rank, seq=seq, op=op, payload=payload),
                         lambda r: isinstance(r, (m.CollectiveReply, m.CollectiveTimeout)) and r.seq == seq,
                         complete, f"{op} #{seq}", now)

    # -- what the run kept --------------------------------------------------------------

    def kept_checkpoints(self, now: float = 0.0) -> Step:
        """Its value is the controller's list of kept checkpoints, once this rank's reports have settled."""
        return self._ask(m.CheckpointsQuery(attempt=self.attempt, rank=self.rank, reports=self.reports),
                         lambda r: isinstance(r, m.CheckpointsList),
                         lambda reply, at: Step(value=list(reply.checkpoints)), "the kept checkpoints", now)

    # -- the end ----------------------------------------------------------------------

    def done(self) -> Step:
        return Step(send=(m.WorkerDone(attempt=self.attempt, rank=self.rank, reports=self.reports),))
