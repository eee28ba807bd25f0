"""Train functions for the standby tests (test_standbys.py): they kill the rank's fork server or
its node's agent once, and say which processes forked each rank."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil

from outlast import train
from outlast.trace import ENV_VAR


def _log(config: dict, **fields) -> None:
    ctx = train.get_context()
    me = psutil.Process()
    fields.update(attempt=ctx.get_attempt(), rank=ctx.get_world_rank(), pid=me.pid, ppid=me.ppid(),
                  grandparent=psutil.Process(me.ppid()).ppid(), t=time.time())
    with open(config["events"], "a") as f:
        f.write(json.dumps(fields) + "\n")


def traced(phase: str) -> list[dict]:
    with open(os.environ[ENV_VAR]) as f:
        return [e for e in map(json.loads, f) if e["phase"] == phase]


def standby_agent() -> tuple[int, int] | None:
    """The standby agent's pid and its fork server's, once that server has imported its modules
    (read from outlast's trace, which every process of the run writes)."""
    for waiting in traced("agent.standby_waiting"):
        for ready in traced("zygote.ready"):
            try:
                if psutil.Process(ready["pid"]).ppid() == waiting["pid"]:
                    return waiting["pid"], ready["pid"]
            except psutil.NoSuchProcess:
                continue
    return None


def kill_once_loop(config: dict) -> None:
    """Attempt 1 waits until config["ready"] says the standby is there, then SIGKILLs config["kill"]:
    "forkserver" (its parent) or "agent" (its grandparent)."""
    ctx = train.get_context()
    _log(config, event="start")
    if ctx.get_attempt() == 1:
        if config["kill"] == "agent":
            deadline = time.monotonic() + 300
            while (found := standby_agent()) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            _log(config, event="standby", standby=found)
        me = psutil.Process()
        victim = me.ppid() if config["kill"] == "forkserver" else psutil.Process(me.ppid()).ppid()
        _log(config, event="kill", victim=victim)
        os.kill(victim, signal.SIGKILL)
        time.sleep(120)  # dies with its fork server
    train.report({"attempt": ctx.get_attempt()})


def spare_loop(config: dict) -> None:
    """Two ranks. In attempt 1, once the fork server has its two spares, rank 1 SIGKILLs one of them
    (as anyone on the machine might), waits for its replacement, then SIGKILLs itself."""
    ctx = train.get_context()
    _log(config, event="start")
    if ctx.get_attempt() == 1:
        if ctx.get_world_rank() == 1:
            deadline = time.monotonic() + 120
            while len(traced("zygote.spare")) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            victim = traced("zygote.spare")[0]["child"]
            os.kill(victim, signal.SIGKILL)
            while len(traced("zygote.spare")) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            _log(config, event="kill", spare_killed=victim, spares=[e["child"] for e in traced("zygote.spare")])
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # stopped when rank 1 dies
    train.report({"attempt": ctx.get_attempt()})


def until_standby_loop(config: dict) -> None:
    """Returns as soon as the node has started a standby fork server: the run ends while the
    standby still imports its modules, the moment a short run's teardown meets."""
    deadline = time.monotonic() + 120
    while not traced("agent.standby_start") and time.monotonic() < deadline:
        time.sleep(0.02)
    train.report({"standby": bool(traced("agent.standby_start"))})
