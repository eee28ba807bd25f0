"""The fork server: imports the heavy modules once, then forks a worker per request.

A restarted worker costs a fork, not a Python start and `import torch`, and most often not even
the fork: once the server has run ranks it keeps as many spares, children forked while it is idle
that wait on a pipe for their request, so a restart's ranks begin at once (`Zygote.spares`). The
server starts no threads and touches no accelerator before forking. It is also the workers'
parent, so it reaps them the moment they die and reports how (exit code or signal,
and the error the worker wrote to its error file).

No process a rank started outlives the rank. Each worker leads its own process group and is
a child subreaper, so its orphaned descendants become its children; when it dies they pass
to the fork server, a subreaper too. So when a worker is reaped, its process group is killed
first (while its zombie still holds the group's id, so no other process can have taken it),
and then every child of the fork server that it did not fork: those can only be what dead
workers left. The fork server ends the same way when its agent goes (SIGTERM on the agent's
death, or the end of its pipe): every worker's group, then whatever they leave to it.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection

import msgspec

from outlast.agent.output import redirect_to
from outlast.agent.worker_user import WorkerUser, drop_to, open_error_file
from outlast.agent.worker_user import decode as decode_user
from outlast.procutil import become_subreaper, decode_wait_status, die_with_parent, kill_tree, own_children
from outlast.protocol import messages as m
from outlast.protocol.transport import TO_ZYGOTE, BadMessage, encode
from outlast.trace import mark

# What a forked child runs, by module path: the agent sits below the training runtime and the
# executor, and starts their code without importing it (each module has a `run(request) -> exit code`).
WORKER_ENTRY = "outlast.train.worker_main"
TASK_ENTRY = "outlast.executor.task_main"
SPARE_AFTER_IDLE_S = 0.05


def preload(modules: list[str]) -> m.ZygoteReady:
    """Import `modules`, then the children's entries: outlast's training runtime costs a second or
    more to import on a busy machine, which every restarted worker would pay after its fork."""
    done, failed = [], {}
    for name in [*modules, WORKER_ENTRY, TASK_ENTRY]:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as e:  # an optional module; workers import what they need themselves
            failed[name] = f"{type(e).__name__}: {e}"
    initialized, driver = cuda_in_this_process()
    return m.ZygoteReady(preloaded=done, failed=failed, cuda_initialized=initialized, cuda_driver_loaded=driver)


def cuda_in_this_process() -> tuple[str, bool]:
    """Whether torch initialized CUDA here (what breaks CUDA in forked children), and whether the
    CUDA driver library is loaded. Asks without initializing it."""
    torch = sys.modules.get("torch")
    initialized = "torch.cuda is initialized" if torch is not None and torch.cuda.is_initialized() else ""
    try:
        with open("/proc/self/maps") as f:
            driver = "libcuda.so" in f.read()
    except OSError:
        driver = False
    return initialized, driver


def read_error_file(path: str) -> m.WorkerError | None:
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=m.WorkerError)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


class Zygote:
    def __init__(self, conn: Connection, worker_user: WorkerUser | None = None) -> None:
        self.conn = conn
        self.worker_user = worker_user
        self.children: dict[int, m.ForkWorker | m.ForkTask] = {}
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_w = wake_w
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
        signal.signal(signal.SIGTERM, lambda *_: None)  # the agent died: end the workers, then go
        # Children forked ahead of their request, each waiting on a pipe (pid -> its write end): a
        # restart's ranks start without waiting for a fork of this large process. As many as the most
        # ranks this server has run at once, since a restart asks for them all again; none until then.
        self.spares: dict[int, int] = {}
        self.spare_target = 0

    def serve(self) -> None:
        while True:
            # A spare is forked once nothing was asked for a moment, not between the requests of a burst
            # (a restart's ranks come a few ms apart), which it would delay by a fork each.
            idle_s = SPARE_AFTER_IDLE_S if len(self.spares) < self.spare_target else None
            try:
                ready, _, _ = select.select([self.conn.fileno(), self.wake_r], [], [], idle_s)
            except InterruptedError:
                continue
            if not ready:  # nothing asked for a while: the time to fork a spare
                try:
                    self.fork_spare()
                except OSError as e:  # no memory or pids for one: restarts fork as they did
                    print(f"outlast fork server: no spare ({e}); workers are forked when asked for", file=sys.stderr)
                    self.spare_target = len(self.spares)
                continue
            if self.wake_r in ready:
                signals = b""
                try:
                    while chunk := os.read(self.wake_r, 4096):
                        signals += chunk
                except BlockingIOError:
                    pass
                if signal.SIGTERM in signals:
                    self.shutdown()
                    return
                self.reap()
            if self.conn.fileno() in ready:
                try:
                    data = self.conn.recv_bytes()
                except (EOFError, OSError):
                    self.shutdown()
                    return
                try:
                    req = TO_ZYGOTE.decode(data)
                except BadMessage as e:  # the agent's own bug, or another outlast's: no fork, and the server stays
                    print(f"outlast fork server: dropped a malformed request: {e}", file=sys.stderr)
                    continue
                self.fork(req)

    def fork(self, req: m.ForkWorker | m.ForkTask) -> None:
        pid = self._hand_to_spare(req)
        if pid is None:
            pid = os.fork()
            if pid == 0:
                self._leave_the_server()
                self._become_worker(req)  # never returns
        self.children[pid] = req
        ranks = sum(isinstance(r, m.ForkWorker) for r in self.children.values())
        self.spare_target = max(self.spare_target, ranks)
        mark("zygote.fork", child=pid, attempt=_attempt(req), rank=_rank(req))
        self.conn.send_bytes(encode(m.Forked(run_id=req.run_id, attempt=_attempt(req), rank=_rank(req), pid=pid,
                                             task_id=_task_id(req), output_file=getattr(req, "output_file", ""))))

    def fork_spare(self) -> None:
        r, w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            raise
        if pid == 0:
            os.close(w)
            self._leave_the_server()
            self._become_worker(self._wait_as_spare(r))  # never returns
        os.close(r)
        self.spares[pid] = w
        mark("zygote.spare", child=pid)

    def _hand_to_spare(self, req: m.ForkWorker | m.ForkTask) -> int | None:
        """The pid of the spare that took `req`, or None when there is none (or each was gone)."""
        data = encode(req)
        while self.spares:
            pid = next(iter(self.spares))  # the oldest
            w = self.spares.pop(pid)
            try:
                with os.fdopen(w, "wb") as f:
                    f.write(len(data).to_bytes(8, "big") + data)
                return pid
            except OSError:  # it died before its request; its reap is an orphan's
                continue
        return None

    @staticmethod
    def _wait_as_spare(r: int) -> m.ForkWorker | m.ForkTask:
        try:
            with os.fdopen(r, "rb") as f:
                head = f.read(8)
                data = f.read(int.from_bytes(head, "big")) if len(head) == 8 else b""
            if not data:
                os._exit(0)  # the fork server ended: no request will come
            return TO_ZYGOTE.decode(data)
        except BaseException:
            traceback.print_exc()
            os._exit(70)

    def _leave_the_server(self) -> None:
        """In a child just forked: what it must not share with the server, done before anything else."""
        try:
            os.setsid()  # a group of its own from the first instant: what it starts is killed with it
            become_subreaper()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (self.wake_r, self.wake_w, *self.spares.values()):
                os.close(fd)
            self.conn.close()
        except BaseException:
            traceback.print_exc()
            os._exit(70)

    def _become_worker(self, req: m.ForkWorker | m.ForkTask) -> None:
        code = 70
        try:
            # Into its own cgroup leaf before anything else: what it allocates from here on is
            # charged to the workloads, never to the node's own processes.
            for procs in req.cgroup_procs:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
            if getattr(req, "output_file", ""):
                redirect_to(req.output_file)  # docs/architecture.md, "Worker output"
            entry = importlib.import_module(TASK_ENTRY if isinstance(req, m.ForkTask) else WORKER_ENTRY)
            if self.worker_user is not None:  # outlast/agent/worker_user.py
                fd = open_error_file(req.error_file, self.worker_user)
                req = msgspec.structs.replace(req, error_file=f"/proc/self/fd/{fd}")
                drop_to(self.worker_user)
            code = entry.run(req)
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)

    def reap(self) -> None:
        while True:
            try:
                # Look before reaping: until then the dead worker's pid, and so its process
                # group's id, cannot be anyone else's.
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid == 0:
                return
            pid = info.si_pid
            req = self.children.pop(pid, None)
            spare = self.spares.pop(pid, None)
            if spare is not None:
                os.close(spare)  # killed before a request came; another is forked when idle
            mark("zygote.reaped", child=pid, ours=req is not None)
            if req is not None:
                kill_tree(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            self.kill_orphans()
            if req is None:
                continue  # an orphan a dead worker left
            exit_code, sig = decode_wait_status(status)
            self.conn.send_bytes(encode(m.Reaped(
                run_id=req.run_id, attempt=_attempt(req), rank=_rank(req), pid=pid,
                exit_code=exit_code, signal=sig, error=read_error_file(req.error_file), task_id=_task_id(req),
            )))

    def kill_orphans(self) -> None:
        """Kill what dead workers left: every child of ours that we did not fork (docstring above)."""
        for pid in own_children() - set(self.children) - set(self.spares):
            try:
                leads_group = os.getpgid(pid) == pid
            except ProcessLookupError:
                continue
            if leads_group:
                kill_tree(pid, signal.SIGKILL)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Kill every worker's group, then reap until no child is left (each dead one may hand
        us orphans), for at most `timeout_s`."""
        for pid in [*self.children, *self.spares]:
            kill_tree(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.kill_orphans()
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                time.sleep(0.01)
            self.children.pop(pid, None)


def _attempt(req: m.ForkWorker | m.ForkTask) -> int:
    return req.attempt if isinstance(req, m.ForkWorker) else 0


def _rank(req: m.ForkWorker | m.ForkTask) -> int:
    return req.spec.rank if isinstance(req, m.ForkWorker) else -1


def _task_id(req: m.ForkWorker | m.ForkTask) -> str:
    return req.task_id if isinstance(req, m.ForkTask) else ""


def main() -> None:
    fd = int(sys.argv[1])
    modules = [s for s in sys.argv[2].split(",") if s] if len(sys.argv) > 2 else []
    worker_user = decode_user(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
    die_with_parent(signal.SIGTERM)  # not SIGKILL: the workers' own children must go too (shutdown)
    os.setsid()  # workers' process groups never include the agent
    become_subreaper()
    conn = Connection(fd)
    mark("zygote.start")
    ready = preload(modules)
    mark("zygote.ready")
    conn.send_bytes(encode(ready))
    Zygote(conn, worker_user).serve()


if __name__ == "__main__":
    main()
