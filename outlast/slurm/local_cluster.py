"""A Slurm cluster of several nodes on this one machine: for the tests, and to try outlast on Slurm.

    python -m outlast.slurm.local_cluster start|stop|status|env   (or scripts/slurm-cluster)

munged, slurmctld and one slurmd per node run in the foreground (-D), started and stopped by
this module, with everything (config, keys, sockets, state, logs) under one private directory
($OUTLAST_SLURM_DIR, default /tmp/outlast-slurm-<uid>). Nodes n1..nN share this host: each
slurmd has its own name and port, and all have NodeAddr=127.0.0.1. Two partitions: `low`,
whose jobs a job of `high` preempts by requeueing them (after USR1 when they asked for it with
`--signal`), and `high`. Needs Slurm 22.05 (`slurmctld slurmd slurm-client munge`) and root.
Standard library only, so it runs before outlast's environment exists.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from outlast.procutil import die_with_parent

PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
NODE_FEATURES = ("rack_a", "rack_a", "rack_b", "rack_b")  # node i's feature: a failure domain for the tests


@dataclass(frozen=True)
class Layout:
    root: Path
    num_nodes: int = 3
    ctld_port: int = 16817
    first_node_port: int = 17001
    grace_s: int = 30  # GraceTime of the low partition: what Slurm allows a preempted job, loosely

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket.2"

    @property
    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.num_nodes + 1)]

    @property
    def env(self) -> dict[str, str]:
        """What Slurm's commands need to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}


def free_port_block(count: int, low: int = 21000, high: int = 30000) -> int:
    """The first of `count` consecutive free TCP ports, below the kernel's ephemeral range and above
    Ray's worker ports, so that clusters of several test sessions on one machine do not collide."""
    import random

    for _ in range(200):
        base = random.randrange(low, high - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports between {low} and {high}")


def default_root() -> Path:
    return Path(os.environ.get("OUTLAST_SLURM_DIR") or f"/tmp/outlast-slurm-{os.getuid()}")


def render_topology(layout: Layout) -> str:
    """The nodes under leaf switches of two nodes each (s1: n1 n2, s2: n3 ...), and those under one top."""
    names = layout.node_names
    leaves = [names[i:i + 2] for i in range(0, len(names), 2)]
    lines = [f"SwitchName=s{i + 1} Nodes={','.join(group)}" for i, group in enumerate(leaves)]
    lines.append(f"SwitchName=top Switches={','.join(f's{i + 1}' for i in range(len(leaves)))}")
    return "\n".join(lines) + "\n"


def render_conf(layout: Layout, host: str) -> str:
    r = layout.root
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={layout.first_node_port + i} CPUs=1 "
        f"RealMemory=1000 Feature={NODE_FEATURES[i % len(NODE_FEATURES)]} State=UNKNOWN"
        for i, name in enumerate(layout.node_names))
    all_nodes = ",".join(layout.node_names)
    return f"""\
ClusterName=outlast
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={layout.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# The default credential lifetime (120 s) holds a requeued job back for that long.
AuthInfo=socket={layout.munge_socket},cred_expire=10
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={r}/log/jobcomp.txt
MpiDefault=none
# Two leaf switches under one (topology.conf), as racks: failure domains for --failure-domain-switch.
TopologyPlugin=topology/tree
ReturnToService=2
SchedulerType=sched/backfill
# Look at pending jobs every 2 s, not every 60: a requeued job starts as soon as it may.
SchedulerParameters=sched_interval=2,bf_interval=2
# Partition priority preempts by requeueing; the user's --signal goes out at preemption, not
# only at the time limit (a SlurmctldParameters flag: SchedulerParameters ignores it).
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
KillWait=5
MinJobAge=300
InactiveLimit=0
{nodes}
PartitionName=low Nodes={all_nodes} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={layout.grace_s}
PartitionName=high Nodes={all_nodes} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


class LocalSlurm:
    def __init__(self, layout: Layout, die_with_caller: bool = False) -> None:
        """`die_with_caller`: the daemons get SIGTERM when the process that started them ends, however
        it ends (a test session killed before its teardown leaves no cluster running)."""
        self.layout = layout
        self.die_with_caller = die_with_caller

    # ---- effects ---------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> None:
        missing = [p for p in PROGRAMS if shutil.which(p) is None]
        if missing:
            raise RuntimeError(f"Slurm is not installed here (missing {', '.join(missing)}): run ./scripts/setup, "
                               "or apt-get install slurmctld slurmd slurm-client munge")
        if os.geteuid() != 0:
            raise RuntimeError("a local Slurm cluster runs its daemons as root: run this as root")
        if self.running():
            if self.ping():
                return
            raise RuntimeError(f"some daemons of the local Slurm cluster in {self.layout.root} are running but "
                               "slurmctld does not answer: run `scripts/slurm-cluster stop` first")
        self._prepare()
        self._spawn("munged", ["munged", "-F", "-f", f"--socket={self.layout.munge_socket}",
                               f"--key-file={self.layout.root / 'munge' / 'munge.key'}",
                               f"--pid-file={self.layout.root / 'run' / 'munged.pid'}",
                               f"--seed-file={self.layout.root / 'munge' / 'munged.seed'}",
                               f"--log-file={self.layout.root / 'log' / 'munged.log'}"])
        self._wait(lambda: self.layout.munge_socket.exists(), timeout_s, "munged to create its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.layout.conf)])
        self._wait(self.ping, timeout_s, "slurmctld to answer")
        for name in self.layout.node_names:
            self._spawn(f"slurmd.{name}", ["slurmd", "-D", "-N", name, "-f", str(self.layout.conf)])
        self._wait(lambda: self.idle_nodes() == set(self.layout.node_names), timeout_s, "every node to be idle")

    def stop(self, timeout_s: float = 60.0) -> None:
        """Cancel every job and wait for it to end before stopping the daemons: a slurmd whose
        slurmctld goes away mid-cancel hangs and leaves its node drained."""
        if self.ping():
            jobs = self.jobs()
            if jobs:
                self._slurm(["scancel", *jobs])
                try:
                    self._wait(lambda: not self.jobs(), timeout_s, "every job to end")
                except TimeoutError as e:
                    print(f"warning: {e}; stopping the daemons anyway", file=sys.stderr)
        for name in [f"slurmd.{n}" for n in self.layout.node_names] + ["slurmctld", "munged"]:
            self._terminate(name, timeout_s=15.0)

    def running(self) -> list[str]:
        names = ["munged", "slurmctld"] + [f"slurmd.{n}" for n in self.layout.node_names]
        return [n for n in names if self._pid(n) is not None]

    def ping(self) -> bool:
        out = self._slurm(["scontrol", "ping"], check=False)
        return out is not None and "is UP" in out

    def idle_nodes(self) -> set[str]:
        out = self._slurm(["sinfo", "-h", "-N", "-o", "%N %t"], check=False) or ""
        return {name for name, state in (line.split() for line in out.splitlines() if line.strip())
                if state == "idle"}

    def jobs(self) -> list[str]:
        out = self._slurm(["squeue", "-h", "-o", "%i"], check=False) or ""
        return out.split()

    def status(self) -> str:
        if not self.running():
            return f"no local Slurm cluster is running in {self.layout.root}"
        lines = [f"local Slurm cluster in {self.layout.root}; daemons: {', '.join(self.running())}"]
        lines.append(self._slurm(["sinfo"], check=False) or "slurmctld does not answer")
        lines.append(self._slurm(["squeue"], check=False) or "")
        lines.append(f"use it with: export SLURM_CONF={self.layout.conf}")
        return "\n".join(lines)

    def _prepare(self) -> None:
        r = self.layout.root
        r.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(r, 0o700)
        for sub in ("etc", "state", "run", "log", "spool", "munge"):
            (r / sub).mkdir(exist_ok=True)
        for name in self.layout.node_names:
            (r / "spool" / name).mkdir(exist_ok=True)
        os.chmod(r / "munge", 0o711)  # munged refuses a socket directory others may write or list
        key = r / "munge" / "munge.key"
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(1024))
        self.layout.conf.write_text(render_conf(self.layout, socket.gethostname().split(".")[0]))
        (self.layout.conf.parent / "topology.conf").write_text(render_topology(self.layout))

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.layout.root / "log" / f"{name}.out", "ab")
        with log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, **self.layout.env},
                                    preexec_fn=partial(die_with_parent, signal.SIGTERM) if self.die_with_caller else None)
        (self.layout.root / "run" / f"{name}.started").write_text(str(proc.pid))

    def _pid(self, name: str) -> int | None:
        """The pid of a daemon this module started and that still runs (never another's)."""
        path = self.layout.root / "run" / f"{name}.started"
        try:
            pid = int(path.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        program = name.split(".")[0]
        if not cmdline or not cmdline[0].endswith(program.encode()):
            return None  # the pid was reused by something else
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return None
        except OSError:
            return None
        return pid

    def _terminate(self, name: str, timeout_s: float) -> None:
        pid = self._pid(name)
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._pid(name) is not None:
            time.sleep(0.1)
        if self._pid(name) is not None:
            print(f"warning: {name} (pid {pid}) did not stop within {timeout_s:.0f} s; killing it", file=sys.stderr)
            os.kill(pid, signal.SIGKILL)
        (self.layout.root / "run" / f"{name}.started").unlink(missing_ok=True)

    def _slurm(self, cmd: list[str], check: bool = True) -> str | None:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20,
                                 env={**os.environ, **self.layout.env})
        except (OSError, subprocess.TimeoutExpired) as e:
            if check:
                raise RuntimeError(f"{' '.join(cmd)}: {e}") from None
            return None
        if out.returncode != 0:
            if check:
                raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
            return None
        return out.stdout

    def _wait(self, cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                logs = self.layout.root / "log"
                raise TimeoutError(f"waited {timeout_s:.0f} s for {what}; see the logs in {logs}")
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in ("start", "stop", "status", "env"):
        print("usage: slurm-cluster start|stop|status|env   (directory: $OUTLAST_SLURM_DIR, "
              f"default {default_root()})", file=sys.stderr)
        return 2
    cluster = LocalSlurm(Layout(default_root()))
    try:
        if argv[0] == "start":
            cluster.start()
            print(f"local Slurm cluster up: nodes {', '.join(cluster.layout.node_names)}, partitions low and high")
            print(f"use it with: export SLURM_CONF={cluster.layout.conf}")
        elif argv[0] == "stop":
            cluster.stop()
            print("local Slurm cluster stopped")
        elif argv[0] == "status":
            print(cluster.status())
        else:
            print(f"export SLURM_CONF={cluster.layout.conf}")
    except (RuntimeError, TimeoutError) as e:
        print(f"slurm-cluster {argv[0]}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
