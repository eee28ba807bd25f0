"""The agent's own files ($OUTLAST_HOME/agents/<node id>/): its workers' error files.

An agent killed without a chance to clean up (SIGKILL, the kernel's OOM killer, a crash)
leaves its directory behind; the next agent to start on this machine removes every one
whose agent is gone, before it claims its own. Its cgroups are cleaned the same way by
isolation (`cleanup_stale` in outlast/isolation/cgroup_v1.py and cgroup_v2.py).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import msgspec

from outlast.client.discovery import state_dir
from outlast.client.liveness import host_id
from outlast.procutil import pid_alive

log = logging.getLogger("outlast.agent")

OWNER = "owner.json"


class Owner(msgspec.Struct):
    pid: int
    host_id: str


def claim(node_id: str, root: Path | None = None) -> Path:
    """Remove what agents that are gone left, then make and return this agent's directory."""
    root = root or state_dir() / "agents"
    root.mkdir(parents=True, exist_ok=True)
    for path in sorted(root.iterdir()):
        why = _stale(path)
        if why:
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s: %s", path, why)
    mine = root / node_id
    if mine.exists():
        raise ValueError(f"another agent with node id {node_id} runs on this machine ({mine}); give this one "
                           "another --node-id")
    mine.mkdir()
    (mine / OWNER).write_bytes(msgspec.json.encode(Owner(os.getpid(), host_id())))
    return mine


def release(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _stale(path: Path) -> str | None:
    """Why `path` belongs to an agent that is gone, or None (alive, or not ours to judge)."""
    try:
        owner = msgspec.json.decode((path / OWNER).read_bytes(), type=Owner)
    except FileNotFoundError:
        return "no owner (an agent that died while it started)" if path.is_dir() else None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    if owner.host_id != host_id():
        return None  # another machine or container sharing $OUTLAST_HOME: its agents are not ours to judge
    if pid_alive(owner.pid):
        return None
    return f"left by an agent (pid {owner.pid}) that is gone"
