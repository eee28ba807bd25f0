"""The cluster as etcd holds it (pure): watch events to the node table, and the head role's duties."""

from __future__ import annotations

import pytest

from outlast.cluster.etcd_store import EtcdConfig
from outlast.cluster.nodetable import UnknownNode
from outlast.cluster.store_view import ClusterView, PutDrain, RecordDeath, StoreEvent, drain_value, node_value
from outlast.cli.store_status import render_store
from outlast.protocol.messages import NodeDraining, NodeInfo, StoreHealth


def node(node_id: str, domain: str = "", used: dict | None = None) -> NodeInfo:
    return NodeInfo(node_id=node_id, address=f"tcp://10.0.0.{node_id[-1]}:6380", host="10.0.0.1",
                    resources={"CPU": 4.0}, failure_domain=domain, used=used or {})


def joined(view: ClusterView, *nodes: NodeInfo) -> ClusterView:
    for n in nodes:
        view.apply(StoreEvent(f"members/{n.node_id}", node_value(n)))
        view.apply(StoreEvent(f"nodes/{n.node_id}", node_value(n)))
    return view


def states(view: ClusterView) -> dict[str, str]:
    return {n.node_id: n.state for n in view.table()}


def test_a_node_is_alive_while_its_leased_key_exists_and_dead_once_it_is_gone():
    view = joined(ClusterView(), node("n1"), node("n2", used={"run": {"CPU": 2.0}}))
    assert states(view) == {"n1": "alive", "n2": "alive"}
    assert view.apply(StoreEvent("nodes/n2", None))  # its lease ended
    table = {n.node_id: n for n in view.table()}
    assert table["n2"].state == "dead" and table["n2"].used == {}  # a dead node holds nothing
    assert view.apply(StoreEvent("nodes/n2", node_value(node("n2"))))  # it came back
    assert states(view)["n2"] == "alive"


def test_the_head_is_marked_and_listed_first_and_a_drain_shows_with_its_notice():
    view = joined(ClusterView(), node("n1"), node("n2"))
    assert view.apply(StoreEvent("head", b"n2"))
    notice = NodeDraining(node_id="n1", reason="preemption", message="spot", deadline_unix_s=100.0, node_ids=["n1"])
    view.apply(StoreEvent("drains/n1", drain_value(notice)))
    table = view.table()
    assert [n.node_id for n in table] == ["n2", "n1"] and table[0].is_head
    assert table[1].state == "draining" and table[1].draining == notice
    assert view.apply(StoreEvent("head", None)) and not any(n.is_head for n in view.table())


def test_a_malformed_value_stays_out_of_the_table_and_is_named():
    view = joined(ClusterView(), node("n1"))
    assert not view.apply(StoreEvent("nodes/n1", b"{not json"))
    assert not view.apply(StoreEvent("unrelated/key", b"x")) and not view.apply(StoreEvent("nodes/", b"x"))
    assert view.malformed == ["nodes/n1"] and states(view) == {"n1": "alive"}


def test_reset_replaces_everything_with_a_full_read():
    view = joined(ClusterView(), node("n1"))
    view.reset([("members/n2", node_value(node("n2"))), ("head", b"n2")])
    assert states(view) == {"n2": "dead"} and view.head == "n2"


def test_a_drain_covers_the_live_nodes_of_the_failure_domain_and_an_unknown_node_is_refused():
    view = joined(ClusterView(), node("n1", "slice-a"), node("n2", "slice-a"), node("n3", "slice-a"), node("n4"))
    view.apply(StoreEvent("nodes/n3", None))  # dead: nothing to drain there
    assert view.domain_of("n2", "preemption", "", 10.0).node_ids == ["n2", "n1"]
    assert view.domain_of("n4", "maintenance", "", None).node_ids == ["n4"]
    with pytest.raises(UnknownNode, match="n1, n2, n3, n4"):
        view.domain_of("n9", "preemption", "", None)


def test_the_head_fans_a_drain_out_once_and_records_each_death_once():
    view = joined(ClusterView(), node("n1", "rack"), node("n2", "rack"), node("n3", "rack"), node("n4"))
    notice = view.domain_of("n1", "preemption", "", 50.0)
    view.apply(StoreEvent("drains/n1", drain_value(notice)))
    view.apply(StoreEvent("nodes/n4", None))
    duties = view.head_duties(now_unix=7.0)
    assert duties == [PutDrain("n2", notice), PutDrain("n3", notice), RecordDeath("n4", 7.0)]
    for duty in duties:  # written by the head; the watch brings them back
        if isinstance(duty, PutDrain):
            view.apply(StoreEvent(f"drains/{duty.node_id}", drain_value(duty.notice)))
        else:
            view.apply(StoreEvent(f"dead/{duty.node_id}", repr(duty.at_unix).encode()))
    assert view.head_duties(now_unix=8.0) == []
    assert states(view) == {"n1": "draining", "n2": "draining", "n3": "draining", "n4": "dead"}
    assert {n.node_id: n.last_seen_unix for n in view.table()}["n4"] == 7.0  # when it was judged dead


def test_etcd_flags_are_checked_and_say_what_to_fix(tmp_path):
    assert EtcdConfig.parse("10.0.0.1:2379, http://10.0.0.2:2379").endpoints == \
        ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]
    with pytest.raises(ValueError, match="http\\(s\\)://HOST:PORT"):
        EtcdConfig.parse("ftp://x:1")
    with pytest.raises(ValueError, match="at least one"):
        EtcdConfig.parse(" , ")
    with pytest.raises(ValueError, match="go together"):
        EtcdConfig.parse("https://x:2379", cert=str(tmp_path))
    with pytest.raises(ValueError, match="no such file"):
        EtcdConfig.parse("https://x:2379", cacert=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="OUTLAST_ETCD_PASSWORD"):
        EtcdConfig.parse("http://x:2379", user="root")
    with pytest.raises(ValueError, match="at least 2 s"):
        EtcdConfig.parse("http://x:2379", lease_ttl_s=1)
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    config = EtcdConfig.parse("x:2379", cacert=str(ca), user="u", password="s3cr3t", lease_ttl_s=4)
    assert config.endpoints == ["https://x:2379"]  # a CA means TLS
    assert EtcdConfig.from_env(config.env()) == config and EtcdConfig.from_env({}) is None
    assert "s3cr3t" not in repr(config)  # the password stays out of logs


def test_status_says_since_when_the_store_is_unavailable_and_what_that_means():
    down = render_store(StoreHealth(kind="etcd", available=False, unavailable_since_unix=1000.0,
                                    detail="no leader", head="n2"), now_unix=1042.0)
    assert "UNAVAILABLE since" in down and "(42 s)" in down and "nothing new is placed" in down
    assert "no leader" in down and "held by n2" in down
    up = render_store(StoreHealth(kind="etcd", head=""), now_unix=0.0)
    assert up.startswith("cluster store: etcd, available") and "no agent holds the head role" in up


def test_a_dead_nodes_drain_does_not_drain_its_peers_again_each_time_they_rejoin():
    view = joined(ClusterView(), node("n1", "rack"), node("n2", "rack"), node("n3", "rack"))
    notice = view.domain_of("n1", "preemption", "", 50.0)
    view.apply(StoreEvent("drains/n1", drain_value(notice)))
    assert view.head_duties(now_unix=1.0) == [PutDrain("n2", notice), PutDrain("n3", notice)]
    for peer in ("n2", "n3"):
        view.apply(StoreEvent(f"drains/{peer}", drain_value(notice)))
    view.apply(StoreEvent("nodes/n1", None))  # the drained node dies; its drain key stays
    view.apply(StoreEvent("dead/n1", b"2.0"))
    for _ in range(3):  # a peer restarted: it deletes its drain and rejoins, again and again
        view.apply(StoreEvent("drains/n2", None))
        view.apply(StoreEvent("nodes/n2", None))
        view.apply(StoreEvent("nodes/n2", node_value(node("n2", "rack"))))
        assert view.head_duties(now_unix=3.0) == []
        assert states(view)["n2"] == "alive"
    # While the origin still lives and drains, a peer that rejoins is drained again: the domain still goes.
    view.apply(StoreEvent("nodes/n1", node_value(node("n1", "rack"))))
    view.apply(StoreEvent("drains/n3", None))
    assert [d.node_id for d in view.head_duties(now_unix=4.0)] == ["n2", "n3"]


def sealed(sealer, key: str, body: bytes) -> StoreEvent:
    return StoreEvent(key, sealer.seal(key, body))


def test_with_the_cluster_key_every_record_is_checked_and_one_without_its_mac_is_refused():
    from outlast.cluster.sealed import Sealer

    ours, theirs = Sealer(b"the cluster's secret"), Sealer(b"another secret")
    view = ClusterView(ours)
    n1 = node("n1")
    for kind in ("members", "nodes"):
        assert view.apply(sealed(ours, f"{kind}/n1", node_value(n1)))
    assert view.apply(sealed(ours, "head", b"n1"))
    notice = NodeDraining(node_id="n1", reason="preemption", message="", deadline_unix_s=None, node_ids=["n1"])
    # Forged: no MAC, another cluster's key, a record moved from another key; each kind of record.
    forged = [StoreEvent("nodes/n9", node_value(node("n9"))), sealed(theirs, "members/n8", node_value(node("n8"))),
              StoreEvent("drains/n1", ours.seal("drains/n2", drain_value(notice))),
              sealed(theirs, "drains/n1", drain_value(notice)), StoreEvent("head", b"n9"),
              sealed(theirs, "dead/n1", b"1.0"), StoreEvent("nodes/n1", b"mac1:" + b"0" * 64 + b":{}")]
    for event in forged:
        assert not view.apply(event)
    assert states(view) == {"n1": "alive"} and view.head == "n1" and view.drain_of("n1") is None
    assert [key for key, _ in view.refused] == [e.key for e in forged]
    assert "carries no MAC" in view.refused[0][1] and "MAC is wrong" in view.refused[1][1]
    # What survives a full read too: the seal is kept across reset.
    view.reset([("members/n1", ours.seal("members/n1", node_value(n1))), ("nodes/n7", node_value(node("n7")))])
    assert states(view) == {"n1": "dead"} and [k for k, _ in view.refused] == ["nodes/n7"]
    assert view.copy().sealer is ours
