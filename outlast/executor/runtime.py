"""`outlast.Executor`: a concurrent.futures.Executor whose tasks run in worker processes of the node.

One background thread owns the ZeroMQ sockets: it admits queued tasks while the node has
room for their requests, sends heartbeats (so the agent kills the tasks if this process
dies), and resolves futures from the tasks' results and exits. Retry decisions are in
`policy.py`. An embedded node whose agent dies is started again (`EmbeddedNode`); the tasks it
ran are lost with it and count as failures of their process: retried on the new node while
`max_retries` allows, else their futures say that the node died and how. What a task prints
(stdout and stderr, kept in a file on its node: outlast/agent/output.py) is printed here, each
line prefixed `[task TASK_ID NODE]`.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import os
import sys
import threading
import time
import uuid
from collections import deque
from typing import Any, Callable, TypeVar

import cloudpickle
import zmq

from outlast.client.discovery import attach, request
from outlast.client.embedded import EmbeddedNode
from outlast.client.preload import default_preload
from outlast.executor.errors import OutOfMemoryError, TaskFailedError
from outlast.executor.tasks import Task, format_task_output
from outlast.executor.policy import (
    RetryConfig, RetryVerdict, on_failure, on_oom_kill, window_after_oom_kill, window_after_success,
)
from outlast.isolation.config import IsolationConfig
from outlast.isolation.units import parse_bytes
from outlast.protocol import messages as m
from outlast.protocol.run_credential import issue
from outlast.protocol.transport import (
    AGENT_EVENTS, Codec, bind_router, connect_dealer, encode, receive_all, route_ip,
)
from outlast.runenv import carried_env, importable_paths
from outlast.storage.records import signal_name

log = logging.getLogger("outlast.executor")
T = TypeVar("T")

TASK_RESULTS: Codec[m.TaskResult] = Codec(m.TaskResult)
HEARTBEAT_S = 0.5
DRIVER_TIMEOUT_S = 5.0
RESULT_GRACE_S = 5.0  # a task that exited 0 may have its result still in flight on the other socket


class Executor(cf.Executor):
    """Run functions in isolated worker processes of the local outlast node.

    Each task asks for `num_cpus` and `memory` (bytes or e.g. "1GiB"); the executor runs as
    many at once as the node's workloads' share fits (and at most `max_workers`). A task
    outlast kills for memory is retried after a backoff, on its own budget `max_oom_retries`
    (-1: no limit); when that is spent its future raises `OutOfMemoryError` with the kill
    report. Other deaths of a task's process count against `max_retries`. Without a running
    node (`outlast start`), the executor starts an embedded one with `isolation`'s settings.
    """

    def __init__(self, max_workers: int | None = None, *, num_cpus: float = 1.0, memory: int | str | None = None,
                 max_retries: int = 3, max_oom_retries: int = -1, retry_exceptions: bool = False,
                 oom_backoff_s: float = 0.5, oom_backoff_max_s: float = 10.0,
                 isolation: IsolationConfig | None = None, preload: list[str] | None = None) -> None:
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        if isinstance(num_cpus, bool) or not isinstance(num_cpus, (int, float)) or not 0 < num_cpus < math.inf:
            raise ValueError(f"num_cpus must be a positive finite number, got {num_cpus!r}")
        self.resources = m.Resources(num_cpus=float(num_cpus),
                                     memory_bytes=parse_bytes(memory, "memory") if memory is not None else 0)
        self.retry = RetryConfig(max_retries=max_retries, max_oom_retries=max_oom_retries,
                                 retry_exceptions=retry_exceptions, oom_backoff_s=oom_backoff_s,
                                 oom_backoff_max_s=oom_backoff_max_s)
        self.session = "exec-" + uuid.uuid4().hex[:10]
        self._queue: deque[Task] = deque()
        self._tasks: dict[str, Task] = {}
        self._lock = threading.Lock()
        self._shutdown = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ctx = zmq.Context()
        self._embedded: EmbeddedNode | None = None
        self._node_changes: list[tuple[str, str]] = []  # from the embedded node's watcher thread
        self._node_down = False
        self._node_gone: str | None = None
        preload = default_preload() if preload is None else list(preload)
        node_args = isolation.to_args() if isolation else []
        access = attach(self._ctx, preload, node_args)
        self._access, self._key = access, access.key
        if access.embedded is not None:
            self._embedded = EmbeddedNode(access.embedded, access.head_address, access.key, preload, node_args,
                                          on_change=self._on_node_change)
        # Tasks get the node's environment, the driver's outlast settings and this executor's own
        # credential: never the cluster key.
        self._task_env = {**carried_env(os.environ, None), **issue(access.authenticator, access.key).env}
        if access.embedded is not None and not (isolation and isolation.enable_resource_isolation):
            # Said out loud: a user who expected the isolated node they started may be looking at
            # tasks that nothing protects from each other's memory.
            log.warning("no outlast node is running on this machine: started one for this executor, without "
                        "resource isolation (`outlast start --enable-resource-isolation`, or "
                        "Executor(isolation=IsolationConfig(enable_resource_isolation=True)))")
        if access.embedded is None and isolation is not None and isolation.enable_resource_isolation:
            log.warning("an outlast node is already running at %s; its own isolation settings apply",
                        access.head_address)
        self.address = address = access.head_address
        reply = request(self._ctx, address, m.StatusRequest(), timeout_s=10.0, key=self._key)
        assert isinstance(reply, m.StatusReply)
        self.max_workers = self._slots(reply.capacity, max_workers)
        self._window = float(self.max_workers)  # shrinks after memory kills, grows back on successes
        self._thread = threading.Thread(target=self._loop, name="outlast-executor", daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait()

    def _slots(self, capacity: m.Resources | None, max_workers: int | None) -> int:
        slots = max_workers or 1 << 30
        if capacity is not None:
            slots = min(slots, max(int(capacity.num_cpus // self.resources.num_cpus), 1))
            if self.resources.memory_bytes:
                slots = min(slots, max(capacity.memory_bytes // self.resources.memory_bytes, 1))
        return slots if slots < 1 << 30 else (os.cpu_count() or 1)

    # ---- concurrent.futures.Executor ----------------------------------------------------------

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        try:
            payload = cloudpickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(f"the task's function or arguments cannot be pickled to send to a worker: {e}") from e
        future: cf.Future[Any] = cf.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit to an outlast.Executor after shutdown()")
            if self._node_gone:
                raise RuntimeError(f"this outlast.Executor has no node to run tasks on: {self._node_gone}")
            task = Task(id=uuid.uuid4().hex[:12], payload=payload, future=future)
            self._tasks[task.id] = task
            self._queue.append(task)
        self._wake()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                for task in self._queue:
                    task.future.cancel()
                    self._tasks.pop(task.id, None)
                self._queue.clear()
        self._wake()
        if wait:
            self._thread.join()

    def _on_node_change(self, state: str, what: str) -> None:
        with self._lock:
            self._node_changes.append((state, what))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    # ---- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        agent = connect_dealer(self._ctx, self.address, key=self._key)
        # Where the node that runs the tasks reaches us: loopback only when it is on this machine.
        results, result_address = bind_router(self._ctx, route_ip(self.address), key=self._key)
        self._agent, self._result_address = agent, result_address
        poller = zmq.Poller()
        poller.register(agent, zmq.POLLIN)
        poller.register(results, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_heartbeat = 0.0
        self._ready.set()
        try:
            while True:
                now = time.monotonic()
                with self._lock:
                    changes, self._node_changes = self._node_changes, []
                for state, what in changes:
                    agent = self._node_changed(state, what, agent, poller)
                if self._node_down:
                    pass  # nothing to heartbeat or admit to until the node is back
                elif now >= next_heartbeat:
                    agent.send(encode(m.RunHeartbeat(run_id=self.session, timeout_s=DRIVER_TIMEOUT_S)))
                    next_heartbeat = now + HEARTBEAT_S
                if not self._node_down:
                    self._admit(now)
                self._expire_lost_results(now)
                with self._lock:
                    if self._shutdown and not self._tasks:
                        return
                for sock, _ in poller.poll(timeout=50):
                    if sock is self._wake_r:
                        try:
                            while os.read(self._wake_r, 4096):
                                pass
                        except BlockingIOError:
                            pass
                    elif sock is agent:
                        self._handle_all(agent, AGENT_EVENTS, self._on_agent_event)
                    else:
                        self._handle_all(results, TASK_RESULTS, self._on_result)
        finally:
            agent.send(encode(m.EndRun(run_id=self.session)))
            agent.close(linger=1000)
            results.close(linger=0)
            self._access.stop_authenticator()
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)
            if self._embedded is not None:
                self._embedded.stop()

    def _node_changed(self, state: str, what: str, agent: zmq.Socket[bytes], poller: zmq.Poller) -> zmq.Socket[bytes]:
        """The embedded node died, came back or is gone for good; returns the socket to the agent."""
        if state == "restarted":
            # A new socket: what the old one queued was meant for the dead agent.
            poller.unregister(agent)
            agent.close(linger=0)
            agent = self._agent = connect_dealer(self._ctx, self.address, key=self._key)
            poller.register(agent, zmq.POLLIN)
            self._node_down = False
            log.warning("%s; the executor's tasks go on there", what)
            return agent
        self._node_down = True
        if state == "gone":
            with self._lock:
                self._node_gone = what
                self._queue.clear()
            for task in list(self._tasks.values()):
                task.running = False
                if not task.future.done():
                    self._resolve(task, error=TaskFailedError(f"task {task.id} cannot run: {what}"))
                self._tasks.pop(task.id, None)
            return agent
        for task in [t for t in self._tasks.values() if t.running]:
            task.running, task.retry_pending, task.exited_ok_at = False, False, None
            if task.future.done():
                self._tasks.pop(task.id, None)
                continue
            task.failures += 1
            outcome = on_failure(task.failures, self.retry, raised=False)
            if outcome.verdict is RetryVerdict.RETRY:
                log.warning("task %s was lost: %s; %s", task.id, what, outcome.reason)
                self._queue_now(task, outcome.delay_s)
            else:
                self._resolve(task, error=TaskFailedError(f"task {task.id} was lost: {what}: {outcome.reason}"))
        return agent

    def _handle_all(self, sock: zmq.Socket[bytes], codec: Codec[T], handle: Callable[[T], None]) -> None:
        for _, msg in receive_all(sock, codec, "message"):
            try:
                handle(msg)
            except Exception:
                # One bad message must not end the loop: every other future would hang.
                log.exception("could not handle a message; the executor goes on")

    def _admit(self, now: float) -> None:
        with self._lock:
            running = sum(1 for t in self._tasks.values() if t.running)
            waiting = []
            while self._queue and running < min(self.max_workers, int(self._window)):
                task = self._queue.popleft()
                if task.not_before > now:
                    waiting.append(task)
                    continue
                if not task.future.running() and not task.future.set_running_or_notify_cancel():
                    self._tasks.pop(task.id, None)  # cancelled while it waited
                    continue
                task.running, task.exited_ok_at, task.output_seq = True, None, 0
                running += 1
                self._agent.send(encode(m.SpawnTask(
                    run_id=self.session, task_id=task.id, controller_address=self._result_address,
                    payload=task.payload, env=self._task_env, cwd=os.getcwd(), sys_path=importable_paths(),
                    resources=self.resources,
                )))
            self._queue.extendleft(reversed(waiting))

    def _on_result(self, msg: m.TaskResult) -> None:
        task = self._tasks.get(msg.task_id)
        if task is None or task.future.done():
            return
        if msg.ok:
            self._window = window_after_success(self._window, self.max_workers)
            try:
                value = cloudpickle.loads(msg.payload)
            except Exception as e:
                self._resolve(task, error=TaskFailedError(
                    f"task {task.id} finished, but its result cannot be unpickled here: {type(e).__name__}: {e}. "
                    "Return something this process can import (plain data, or classes of an importable module)"))
                return
            self._resolve(task, value=value)
            return
        outcome = on_failure(task.failures + 1, self.retry, raised=True)
        if outcome.verdict is RetryVerdict.RETRY:
            task.failures += 1
            self._requeue(task, outcome.delay_s, wait_for_exit=True)
            return
        try:
            exc = cloudpickle.loads(msg.payload) if msg.payload else None
        except Exception:
            exc = None
        if not isinstance(exc, BaseException):
            err = msg.error
            exc = (RuntimeError(f"{err.exc_type or err.kind}: {err.message}\n{err.traceback}") if err
                   else RuntimeError("the task failed"))
        self._resolve(task, error=exc)

    def _on_agent_event(self, ev: m.AgentEvent) -> None:
        if isinstance(ev, m.WorkerOutput) and ev.task_id:
            self._print_output(ev)
            return
        if not isinstance(ev, m.TaskExited):
            return
        task = self._tasks.get(ev.task_id)
        if task is None:
            return
        task.running = False
        if task.future.done():
            self._tasks.pop(task.id, None)
            return
        if task.retry_pending:
            task.retry_pending = False
            self._queue_now(task, 0.0)
            return
        if ev.kill_report is not None:
            running = sum(1 for t in self._tasks.values() if t.running)
            self._window = window_after_oom_kill(self._window, running)
            task.oom_kills += 1
            task.reports.append(ev.kill_report)
            outcome = on_oom_kill(task.oom_kills, self.retry)
            if outcome.verdict is RetryVerdict.RETRY:
                log.info("task %s: %s", task.id, outcome.reason)
                self._requeue(task, outcome.delay_s)
            else:
                self._resolve(task, error=OutOfMemoryError(
                    f"task {task.id} was killed for memory by outlast: {outcome.reason}\n{ev.oom_report or ''}",
                    task.reports))
            return
        if ev.exit_code == 0:
            task.exited_ok_at = time.monotonic()  # its TaskResult is on the way
            return
        how = f"was killed by {signal_name(ev.signal)}" if ev.signal is not None else f"exited with code {ev.exit_code}"
        task.failures += 1
        outcome = on_failure(task.failures, self.retry, raised=False)
        if outcome.verdict is RetryVerdict.RETRY:
            log.warning("task %s %s; %s", task.id, how, outcome.reason)
            self._requeue(task, outcome.delay_s)
        else:
            self._resolve(task, error=TaskFailedError(f"task {task.id} {how} on node {ev.node_id}: {outcome.reason}",
                                                     ev.exit_code, ev.signal))

    def _print_output(self, ev: m.WorkerOutput) -> None:
        task = self._tasks.get(ev.task_id)
        sys.stdout.write(format_task_output(ev, task.output_seq if task is not None else ev.seq))
        sys.stdout.flush()
        if task is not None:
            task.output_seq = ev.seq + len(ev.lines)

    def _requeue(self, task: Task, delay_s: float, wait_for_exit: bool = False) -> None:
        if wait_for_exit and task.running:
            task.retry_pending = True
            return
        self._queue_now(task, delay_s)

    def _queue_now(self, task: Task, delay_s: float) -> None:
        task.not_before = time.monotonic() + delay_s
        with self._lock:
            self._queue.append(task)

    def _expire_lost_results(self, now: float) -> None:
        for task in list(self._tasks.values()):
            if task.exited_ok_at is not None and now - task.exited_ok_at > RESULT_GRACE_S \
                    and not task.future.done():
                self._resolve(task, error=TaskFailedError(
                    f"task {task.id} exited without sending its result within {RESULT_GRACE_S:.0f} s"))

    def _resolve(self, task: Task, value: Any = None, error: BaseException | None = None) -> None:
        if error is not None:
            task.future.set_exception(error)
        else:
            task.future.set_result(value)
        if not task.running:
            self._tasks.pop(task.id, None)

