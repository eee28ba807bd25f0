from outlast.controller.placement import NoCapacity, NodeView, Placement, place


def nodes(*cpus, draining=()):
    return [NodeView(f"n{i}", f"tcp://h{i}", {"CPU": c}, draining=f"n{i}" in draining) for i, c in enumerate(cpus)]


def layout(p: Placement):
    return [(node.node_id, s.rank, s.local_rank, s.node_rank, s.local_world_size) for node, s in p.workers]


def test_pack_fills_a_node_before_the_next_with_consecutive_ranks_per_node():
    p = place(nodes(2, 4), 3, {"CPU": 1})
    assert layout(p) == [("n0", 0, 0, 0, 2), ("n0", 1, 1, 0, 2), ("n1", 2, 0, 1, 1)]


def test_spread_deals_ranks_over_nodes_but_keeps_a_nodes_ranks_consecutive():
    p = place(nodes(4, 4), 4, {"CPU": 1}, "SPREAD")
    assert layout(p) == [("n0", 0, 0, 0, 2), ("n0", 1, 1, 0, 2), ("n1", 2, 0, 1, 2), ("n1", 3, 1, 1, 2)]


def test_draining_nodes_get_no_new_work():
    p = place(nodes(4, 4, draining=("n0",)), 2, {"CPU": 1})
    assert {node.node_id for node, _ in p.workers} == {"n1"}


def test_strict_pack_needs_one_node_for_all_ranks():
    assert isinstance(place(nodes(2, 2), 3, {"CPU": 1}, "STRICT_PACK"), NoCapacity)
    assert {n.node_id for n, _ in place(nodes(2, 4), 3, {"CPU": 1}, "STRICT_PACK").workers} == {"n1"}


def test_strict_spread_needs_one_node_per_rank():
    assert isinstance(place(nodes(4, 4), 3, {"CPU": 1}, "STRICT_SPREAD"), NoCapacity)
    assert [n.node_id for n, _ in place(nodes(4, 4, 4), 3, {"CPU": 1}, "STRICT_SPREAD").workers] == ["n0", "n1", "n2"]


def test_no_capacity_says_how_many_nodes_were_usable_and_how_many_drain():
    result = place(nodes(1, 8, draining=("n1",)), 2, {"CPU": 1})
    assert isinstance(result, NoCapacity)
    assert "1 usable node(s)" in result.reason and "1 draining" in result.reason


def test_workers_needing_nothing_fit_anywhere():
    assert len(place(nodes(0), 3, {}).workers) == 3
