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

No secret of a run ever enters this process: every child forked later would inherit it. The
server gets a `ForkChild` (what to run, where, what to report) and an fd it never reads; the child
reads its request from that fd after the fork (outlast/agent/fork_request.py), a spare too.

Its standby (the server that takes its place when it dies) is forked from it too, on `ForkStandby`,
before any worker: a copy whose imports are done and whose pages it shares, rather than a second
Python importing torch again (seconds of CPU, and as much memory again). The standby leads its own
session, serves a socket of its own to the agent, and is not killed with the workers' orphans; it
outlives this server when this server dies (the case it is for), and ends when the agent goes (the
end of its own socket) or when this server is stopped.
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle

import msgspec

from outlast.agent import fork_request
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
NO_FULL_COLLECTION = 10**9  # gc's third threshold while the server imports: the full collections never come


def preload(modules: list[str]) -> m.ZygoteReady:
    """Import `modules`, then the children's entries: outlast's training runtime costs a second or
    more to import on a busy machine, which every restarted worker would pay after its fork.

    Then freeze what the imports made out of the collector (`gc.freeze()`), before the first fork: a
    rank's first full collection would otherwise write to every object it was forked with (the
    collector's bookkeeping sits in each object's header), copying the server's pages into the rank,
    about 70 MiB a rank after torch and torch._dynamo, and taking 0.2 s instead of 1 ms (docs/benchmarks.md).
    Frozen, the import's objects are never collected: a cycle among them that becomes garbage stays.

    While importing, no full collection: torch and torch._dynamo make some 500,000 objects, each full
    collection walks all made so far, and together they were about 0.4 s of the import's 2.3 s of CPU
    (`preload_cpu` in bench/results/startup-profile.json).
    The young collections still free the imports' own cycles (the server's memory is as large as with
    them). The thresholds are as before once the imports are done, in the server and so in every child."""
    done, failed = [], {}
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], NO_FULL_COLLECTION)
    try:
        for name in [*modules, WORKER_ENTRY, TASK_ENTRY]:
            try:
                importlib.import_module(name)
                done.append(name)
            except Exception as e:  # an optional module; workers import what they need themselves
                failed[name] = f"{type(e).__name__}: {e}"
    finally:
        gc.set_threshold(*thresholds)
    gc.freeze()
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
    def __init__(self, conn: Connection, worker_user: WorkerUser | None = None,
                 ready: m.ZygoteReady | None = None) -> None:
        self.conn = conn
        self.worker_user = worker_user
        self.ready = ready  # what this server's imports gave: what a standby forked from it reports too
        self.children: dict[int, m.ForkChild] = {}
        self.standbys: set[int] = set()  # forked on ForkStandby: the agent's, neither workers nor orphans
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_w = wake_w
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
        signal.signal(signal.SIGTERM, lambda *_: None)  # the agent died: end the workers, then go
        # Children forked ahead of their request, each waiting on a socket (pid -> our end): a
        # restart's ranks start without waiting for a fork of this large process. As many as the most
        # ranks this server has run at once, since a restart asks for them all again; none until then.
        self.spares: dict[int, Connection] = {}
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
                if signal.SIGTERM in signals:  # the agent died (PR_SET_PDEATHSIG), or ended us before we were ready
                    self.agent_gone()
                    return
                self.reap()
            if self.conn.fileno() in ready:
                try:
                    order = TO_ZYGOTE.decode(self.conn.recv_bytes())
                    fd = recv_handle(self.conn) if isinstance(order, (m.ForkChild, m.ForkStandby)) else -1
                except BadMessage as e:  # the agent's own bug, or another outlast's: no fork, and the server stays
                    print(f"outlast fork server: dropped a malformed request: {e}", file=sys.stderr)
                    continue
                except (EOFError, OSError, RuntimeError):
                    self.agent_gone()
                    return
                if isinstance(order, m.StopForking):
                    self.shutdown()
                    return
                if isinstance(order, m.ForkStandby):
                    self.fork_standby(fd)
                    continue
                self.fork(order, fd)

    def fork(self, order: m.ForkChild, fd: int) -> None:
        """Fork `order`'s child (or hand it to a spare) with the fd of its request, which this
        process never reads and closes here: a later child must not inherit it."""
        try:
            pid = self._hand_to_spare(order, fd)
            if pid is None:
                pid = os.fork()
                if pid == 0:
                    self._leave_the_server()
                    self._become_worker(order, fd)  # never returns
        finally:
            os.close(fd)
        self.children[pid] = order
        ranks = sum(o.kind == "worker" for o in self.children.values())
        self.spare_target = max(self.spare_target, ranks)
        mark("zygote.fork", child=pid, attempt=order.attempt, rank=order.rank)
        self._tell(m.Forked(run_id=order.run_id, attempt=order.attempt, rank=order.rank, pid=pid,
                            task_id=order.task_id, output_file=order.output_file))

    def fork_standby(self, fd: int) -> None:
        """Fork a standby server that serves the socket `fd` (closed here: it is the standby's alone)."""
        try:
            pid = os.fork()
        except OSError as e:  # no memory or pids: the agent sees the socket end, and tries again later
            print(f"outlast fork server: no standby ({e})", file=sys.stderr)
            os.close(fd)
            return
        if pid == 0:
            self._leave_the_server()
            self.standbys.clear()
            serve_as_standby(Connection(fd), self.worker_user, self.ready)  # never returns
        os.close(fd)
        self.standbys.add(pid)
        mark("zygote.standby", child=pid)

    def fork_spare(self) -> None:
        ours, theirs = (Connection(s.detach()) for s in socket.socketpair())
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:
            ours.close()
            self._leave_the_server()
            self._become_worker(*self._wait_as_spare(theirs))  # never returns
        theirs.close()
        self.spares[pid] = ours
        mark("zygote.spare", child=pid)

    def _hand_to_spare(self, order: m.ForkChild, fd: int) -> int | None:
        """The pid of the spare that took `order` and `fd`, or None when there is none (or each was gone)."""
        data = encode(order)
        while self.spares:
            pid: int = next(iter(self.spares))  # the oldest
            conn = self.spares.pop(pid)
            try:
                conn.send_bytes(data)
                send_handle(conn, fd, pid)
                return pid
            except OSError:  # it died before its request; its reap is an orphan's
                continue
            finally:
                conn.close()
        return None

    @staticmethod
    def _wait_as_spare(conn: Connection) -> tuple[m.ForkChild, int]:
        try:
            try:
                order = TO_ZYGOTE.decode(conn.recv_bytes())
                fd = recv_handle(conn)
            except EOFError:
                os._exit(0)  # the fork server ended: no request will come
            conn.close()
            if not isinstance(order, m.ForkChild):
                raise TypeError(f"a spare was sent {type(order).__name__}, not a ForkChild")
            return order, fd
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
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            for conn in (*self.spares.values(), self.conn):
                conn.close()
        except BaseException:
            traceback.print_exc()
            os._exit(70)

    def _become_worker(self, order: m.ForkChild, fd: int) -> None:
        code = 70
        try:
            # Into its own cgroup leaf before anything else: what it allocates from here on is
            # charged to the workloads, never to the node's own processes.
            for procs in order.cgroup_procs:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
            if order.output_file:
                redirect_to(order.output_file)  # docs/architecture.md, "Worker output"
            req = fork_request.read(fd)
            want = m.ForkTask if order.kind == "task" else m.ForkWorker
            if not isinstance(req, want) or req.run_id != order.run_id:
                raise ValueError(f"the request of {order.kind} {order.run_id} is {type(req).__name__} "
                                 f"of run {req.run_id}")
            entry = importlib.import_module(TASK_ENTRY if order.kind == "task" else WORKER_ENTRY)
            if self.worker_user is not None:  # outlast/agent/worker_user.py
                efd = open_error_file(req.error_file, self.worker_user)
                req = msgspec.structs.replace(req, error_file=f"/proc/self/fd/{efd}")
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

    def _tell(self, msg: m.FromZygote) -> None:
        """A report to the agent. A pipe it closed is not an error here: the next read of it says
        how it ended (`StopForking`, or an end of file while workloads ran: `agent_gone`)."""
        try:
            self.conn.send_bytes(encode(msg))
        except OSError:
            pass

    def agent_gone(self) -> None:
        """The agent died (its pipe ended without `StopForking`, or SIGTERM): say so if workloads
        ran here, then end them."""
        if self.children:
            print(f"outlast fork server: its agent went away while {len(self.children)} workload(s) ran "
                  f"(pids {', '.join(map(str, self.children))}); ending them", file=sys.stderr)
        self.shutdown()

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
            order = self.children.pop(pid, None)
            spare = self.spares.pop(pid, None)
            if spare is not None:
                spare.close()  # killed before a request came; another is forked when idle
            if pid in self.standbys:  # the agent sees its socket end, and says how
                self.standbys.discard(pid)
                os.waitpid(pid, 0)
                continue
            mark("zygote.reaped", child=pid, ours=order is not None)
            if order is not None:
                kill_tree(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            self.kill_orphans()
            if order is None:
                continue  # an orphan a dead worker left
            exit_code, sig = decode_wait_status(status)
            self._tell(m.Reaped(
                run_id=order.run_id, attempt=order.attempt, rank=order.rank, pid=pid,
                exit_code=exit_code, signal=sig, error=read_error_file(order.error_file), task_id=order.task_id,
            ))

    def kill_orphans(self) -> None:
        """Kill what dead workers left: every child of ours that we did not fork (docstring above)."""
        for pid in own_children() - set(self.children) - set(self.spares) - self.standbys:
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
        for pid in [*self.children, *self.spares, *self.standbys]:  # a standby goes with the server it stands by
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


def serve_as_standby(conn: Connection, worker_user: WorkerUser | None, ready: m.ZygoteReady | None) -> None:
    """In a standby just forked: say it is ready (its modules are its server's), then serve as a server does."""
    code = 0
    try:
        standby = Zygote(conn, worker_user, ready)
        conn.send_bytes(encode(msgspec.structs.replace(ready or m.ZygoteReady(preloaded=[], failed={}),
                                                       pid=os.getpid())))
        standby.serve()
    except OSError:
        pass  # the agent went before it was told: nothing ran here
    except BaseException:
        traceback.print_exc()
        code = 70
    finally:
        os._exit(code)


def main() -> None:
    fd = int(sys.argv[1])
    modules = [s for s in sys.argv[2].split(",") if s] if len(sys.argv) > 2 else []
    worker_user = decode_user(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
    die_with_parent(signal.SIGTERM)  # not SIGKILL: the workers' own children must go too (shutdown)
    os.setsid()  # workers' process groups never include the agent
    become_subreaper()
    conn = Connection(fd)
    mark("zygote.start")
    ready = msgspec.structs.replace(preload(modules), pid=os.getpid())
    mark("zygote.ready")
    try:
        conn.send_bytes(encode(ready))
    except OSError:
        return  # the agent stopped while we imported (a short run's standby): nothing ran here
    Zygote(conn, worker_user, ready).serve()


if __name__ == "__main__":
    main()
