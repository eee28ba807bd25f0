"""Whether a node's agent process still exists, seen from a process on the same machine.

A driver on the machine of a node (an embedded node, a `LocalCluster`, `outlast start` beside
the script) need not wait for a node's heartbeat timeout to learn that its agent is gone: the
process table says so at once. The agent names its pid and its host (machine id, boot id and
pid namespace, so that two containers with pids of their own never match) in its node table
entry; anyone else falls back to heartbeats.
"""

from __future__ import annotations

import functools

import msgspec

from outlast.identity import host_id as _host_id
from outlast.procutil import pid_alive
from outlast.protocol import messages as m

_how: dict[int, str] = {}  # pid -> how it ended, from whoever reaped it in this process


@functools.cache
def host_id() -> str:
    """This machine, boot and pid namespace (`outlast.identity.host_id`), read once per process."""
    return _host_id()


def note_exit(pid: int, how: str) -> None:
    """The parent of an agent says how it ended, for the reason `agent_gone` gives."""
    _how[pid] = how


def agent_gone(node: m.NodeInfo) -> str | None:
    """None while the node's agent may live (or cannot be checked from here); else why it is lost."""
    if not node.agent_pid or not node.host_id or node.host_id != host_id() or pid_alive(node.agent_pid):
        return None
    how = _how.get(node.agent_pid)
    return (f"the node agent of node {node.node_id} (pid {node.agent_pid}) is gone"
            + (f": {how}" if how else " from this machine"))


def mark_gone_dead(node: m.NodeInfo) -> m.NodeInfo:
    """The node as the head's table has it, but dead if its agent is gone: never shown alive."""
    return msgspec.structs.replace(node, state="dead", used={}) if node.state != "dead" and agent_gone(node) else node
