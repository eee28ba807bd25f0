"""Process-tree helpers for the benchmarks: peak-PSS sampling, and finding and stopping what they started."""
import os
import threading
import time

import psutil


def _self_and_ancestors():
    me = psutil.Process()
    return {me.pid} | {p.pid for p in me.parents()}


def new_processes(before_pids, since, keyword):
    """Processes that appeared after `since` and mention `keyword`.

    `ray start` / `outlast start` leave daemons reparented away from us, so
    lineage cannot find them; what they run and when they started can.
    """
    skip = _self_and_ancestors()
    found = []
    for p in psutil.process_iter(["cmdline", "create_time"]):
        if p.pid in before_pids or p.pid in skip:
            continue
        if (p.info["create_time"] or 0) < since - 1:
            continue
        if keyword in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


class PssSampler:
    """Samples total PSS of some roots plus all their descendants.

    PSS rather than RSS: a dozen processes share the torch and framework
    libraries, and RSS would count those pages once per process.
    """

    def __init__(self, roots, interval=0.1):
        self.roots = list(roots)
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def add_root(self, proc):
        self.roots.append(proc)

    def _tree(self):
        procs = {}
        for root in list(self.roots):
            try:
                if not root.is_running():
                    continue
                procs[root.pid] = root
                for child in root.children(recursive=True):
                    procs[child.pid] = child
            except psutil.Error:
                continue
        return procs

    def sample(self):
        total = 0
        for proc in self._tree().values():
            try:
                total += proc.memory_full_info().pss
            except psutil.Error:
                continue
        self.peak = max(self.peak, total)
        return total

    def _run(self):
        while not self._stop.is_set():
            started = time.monotonic()
            self.sample()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.peak


def alive(procs):
    """Those of `procs` still running (a zombie is not)."""
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            pass
    return out


def ours(var, value, before=(), since=0.0):
    """Processes whose environment carries `var=value`, the private state directory this
    benchmark gave everything it started (and that they pass on to their children)."""
    me = os.getpid()
    found = []
    for p in psutil.process_iter(["create_time"]):
        if p.pid == me or p.pid in before or (p.info["create_time"] or 0) < since - 1:
            continue
        try:
            if p.environ().get(var) == value:
                found.append(p)
        except psutil.Error:
            pass
    return found


def kill_all(procs, grace=3.0):
    """SIGTERM, then SIGKILL whatever is still there after `grace` seconds."""
    skip = _self_and_ancestors()
    procs = [p for p in procs if p.pid not in skip]
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace)
    return len(procs)


def pids():
    return set(psutil.pids())


def killpg(pid):
    try:
        os.killpg(pid, 9)
    except OSError:
        pass
