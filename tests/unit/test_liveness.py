"""A node whose agent process is gone from this machine is lost at once, and never shown alive."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec

from outlast.agent.roles import HeadNode
from outlast.client.liveness import agent_gone, host_id, mark_gone_dead, note_exit
from outlast.controller.nodes import NodeBook
from outlast.protocol import messages as m


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _node(node_id: str, pid: int, host: str | None = None) -> m.NodeInfo:
    return m.NodeInfo(node_id=node_id, address=f"tcp://127.0.0.1:{1000 + len(node_id)}", host="127.0.0.1",
                      resources={"CPU": 1.0}, agent_pid=pid, host_id=host_id() if host is None else host)


def test_a_live_agent_on_this_machine_is_not_gone():
    assert host_id()
    assert agent_gone(_node("n1", os.getpid())) is None


def test_a_dead_agent_on_this_machine_is_gone_and_says_how_if_its_parent_said():
    pid = _dead_pid()
    assert "pid %d) is gone from this machine" % pid in agent_gone(_node("n1", pid))
    note_exit(pid, "killed by SIGKILL")
    assert agent_gone(_node("n1", pid)).endswith("is gone: killed by SIGKILL")


def test_an_agent_elsewhere_or_of_an_older_version_is_left_to_heartbeats():
    pid = _dead_pid()
    assert agent_gone(_node("n1", pid, host="another-boot/4026531836")) is None
    assert agent_gone(_node("n1", 0)) is None
    assert agent_gone(_node("n1", pid, host="")) is None


def test_a_table_entry_of_a_gone_agent_reads_dead():
    node = msgspec.structs.replace(_node("n1", _dead_pid()), used={"r": {"CPU": 1.0}})
    assert mark_gone_dead(node).state == "dead" and mark_gone_dead(node).used == {}
    alive = _node("n2", os.getpid())
    assert mark_gone_dead(alive) is alive


def test_the_head_declares_a_member_dead_as_soon_as_its_agent_is_gone():
    head = HeadNode("head", node_timeout_s=60.0)
    me = _node("head", os.getpid())
    head.join(me)
    head.on_peer(b"m1", m.RegisterNode(node=_node("m1", _dead_pid())), now=0.0)
    head.on_peer(b"m2", m.RegisterNode(node=_node("m2", os.getpid())), now=0.0)
    head.tick(me, now=1.0)  # long before the 60 s heartbeat timeout
    states = {n.node_id: n.state for n in head.nodes(me, 1.0)}
    assert states == {"head": "alive", "m1": "dead", "m2": "alive"}


def test_the_drivers_view_never_calls_a_node_with_a_gone_agent_alive_even_from_a_table_read_before():
    book = NodeBook()
    head = msgspec.structs.replace(_node("head", os.getpid()), is_head=True)
    book.set_table([head])  # as last read, while its agent lived
    assert book.describe() == "head (alive)"
    book.note_gone("head", agent_gone(msgspec.structs.replace(head, agent_pid=_dead_pid())))
    assert book.describe() == "head (dead)"
    assert book.lost_nodes(0.0, {"head"})["head"].startswith("the node agent of node head")


def test_the_worker_group_reports_a_node_whose_agent_is_gone_once_and_shows_it_dead():
    import threading

    import zmq

    from outlast.controller.agent_group import AgentGroup
    from outlast.controller.group import AgentGone
    from outlast.protocol.transport import bind_router, encode

    ctx = zmq.Context()
    head_sock, head_address = bind_router(ctx)
    group = AgentGroup(ctx, head_address, None)
    try:
        gone, alive = _node("gone", _dead_pid()), _node("alive", os.getpid())
        stop = threading.Event()

        def serve_table():  # the head's one answer: a table naming both nodes
            while not stop.is_set():
                if head_sock.poll(10):
                    identity, _ = head_sock.recv_multipart()
                    head_sock.send_multipart([identity, encode(m.NodeList(nodes=[gone, alive]))])

        server = threading.Thread(target=serve_table)
        server.start()
        try:
            nodes = group.refresh(timeout_s=10.0)
        finally:
            stop.set()
            server.join()
        assert {n.node_id: n.state for n in nodes} == {"gone": "dead", "alive": "alive"}
        first = [e for e in group.events(0.0) if isinstance(e, AgentGone)]
        assert [e.node_id for e in first] == ["gone"] and "is gone" in first[0].why
        assert not [e for e in group.events(0.0) if isinstance(e, AgentGone)]  # said once
    finally:
        group.close()
        head_sock.close(linger=0)
        ctx.term()


def test_a_lost_node_gets_no_work_until_a_new_agent_is_behind_its_id():
    book = NodeBook()
    old = _node("n1", os.getpid())
    book.set_table([old])
    book.lose("n1", 100.0)
    assert book.views("r", 101.0) == []  # the same agent: maybe a partition, kept out for a while
    book.set_table([msgspec.structs.replace(old, agent_pid=os.getppid())])  # started again
    assert [v.node_id for v in book.views("r", 101.0)] == ["n1"]


def test_a_node_whose_agent_was_reported_gone_is_not_lost_again_once_a_new_agent_runs_behind_its_id():
    book = NodeBook()
    old = _node("n1", _dead_pid())
    book.set_table([old])
    book.note_gone("n1", agent_gone(old))
    assert "is gone" in book.lost_nodes(0.0, {"n1"})["n1"]
    book.set_table([msgspec.structs.replace(old, agent_pid=os.getpid())])  # restarted by its supervisor
    assert book.lost_nodes(0.0, {"n1"}) == {}
    assert book.describe() == "n1 (alive)"
