"""The fork server: imports the heavy modules once, then forks a worker per request.

A restarted worker costs a fork, not a Python start and `import torch`. The server
starts no threads and touches no accelerator before forking. It is also the workers'
parent, so it reaps them the moment they die and reports how (exit code or signal,
and the error the worker wrote to its error file).
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import sys
import traceback
from multiprocessing.connection import Connection

import msgspec

from outlast.agent.output import redirect_to
from outlast.procutil import decode_wait_status, die_with_parent, kill_tree
from outlast.protocol import messages as m
from outlast.protocol.transport import TO_ZYGOTE, encode

# What a forked child runs, by module path: the agent sits below the training runtime and the
# executor, and starts their code without importing it (each module has a `run(request) -> exit code`).
WORKER_ENTRY = "outlast.train.worker_main"
TASK_ENTRY = "outlast.executor.task_main"


def preload(modules: list[str]) -> m.ZygoteReady:
    done, failed = [], {}
    for name in modules:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as e:  # an optional module; workers import what they need themselves
            failed[name] = f"{type(e).__name__}: {e}"
    initialized, driver = cuda_in_this_process()
    return m.ZygoteReady(preloaded=done, failed=failed, cuda_initialized=initialized, cuda_driver_loaded=driver)


def cuda_in_this_process() -> tuple[str, bool]:
    """Whether torch initialized CUDA here (what breaks CUDA in forked children), by which module
    if one is known, and whether the CUDA driver library is loaded. Asks without initializing it."""
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
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.children: dict[int, m.ForkWorker | m.ForkTask] = {}
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_w = wake_w
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def serve(self) -> None:
        while True:
            try:
                ready, _, _ = select.select([self.conn.fileno(), self.wake_r], [], [])
            except InterruptedError:
                continue
            if self.wake_r in ready:
                try:
                    while os.read(self.wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                self.reap()
            if self.conn.fileno() in ready:
                try:
                    data = self.conn.recv_bytes()
                except (EOFError, OSError):
                    self.shutdown()
                    return
                self.fork(TO_ZYGOTE.decode(data))

    def fork(self, req: m.ForkWorker | m.ForkTask) -> None:
        pid = os.fork()
        if pid == 0:
            self._become_worker(req)  # never returns
        self.children[pid] = req
        self.conn.send_bytes(encode(m.Forked(run_id=req.run_id, attempt=_attempt(req), rank=_rank(req), pid=pid,
                                             task_id=_task_id(req), output_file=getattr(req, "output_file", ""))))

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
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(self.wake_r)
            os.close(self.wake_w)
            self.conn.close()
            entry = importlib.import_module(TASK_ENTRY if isinstance(req, m.ForkTask) else WORKER_ENTRY)
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
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            req = self.children.pop(pid, None)
            if req is None:
                continue
            exit_code, sig = decode_wait_status(status)
            self.conn.send_bytes(encode(m.Reaped(
                run_id=req.run_id, attempt=_attempt(req), rank=_rank(req), pid=pid,
                exit_code=exit_code, signal=sig, error=read_error_file(req.error_file), task_id=_task_id(req),
            )))

    def shutdown(self) -> None:
        for pid in list(self.children):
            kill_tree(pid, signal.SIGKILL)


def _attempt(req: m.ForkWorker | m.ForkTask) -> int:
    return req.attempt if isinstance(req, m.ForkWorker) else 0


def _rank(req: m.ForkWorker | m.ForkTask) -> int:
    return req.spec.rank if isinstance(req, m.ForkWorker) else -1


def _task_id(req: m.ForkWorker | m.ForkTask) -> str:
    return req.task_id if isinstance(req, m.ForkTask) else ""


def main() -> None:
    fd = int(sys.argv[1])
    modules = [s for s in sys.argv[2].split(",") if s] if len(sys.argv) > 2 else []
    die_with_parent()
    os.setsid()  # workers' process groups never include the agent
    conn = Connection(fd)
    conn.send_bytes(encode(preload(modules)))
    Zygote(conn).serve()


if __name__ == "__main__":
    main()
