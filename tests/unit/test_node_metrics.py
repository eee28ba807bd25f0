"""The node's metrics from what the agent holds: workloads by kind, memory per cgroup and per
leaf (series of gone leaves removed), kills by what set them off; the endpoint's settings."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from outlast.agent.metrics import NodeMetrics
from outlast.metrics import Endpoint, MetricsError, endpoint, endpoint_from_env
from outlast.protocol import messages as m


class Guard:
    def __init__(self):
        self.leaves = {"r-a1-r0": 300, "r-a1-r1": 500}

    def info(self):
        return SimpleNamespace(system_memory=100, user_memory=800, user_limit=4000)

    def leaf_memory(self, leaf):
        return self.leaves[leaf]


def _scrape(url):
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _workload(leaf, task_id=""):
    return SimpleNamespace(leaf=leaf, task_id=task_id)


@pytest.fixture
def metrics():
    nm = NodeMetrics("node-7", Endpoint("127.0.0.1", 0))
    yield nm
    nm.close()


def test_workloads_memory_and_kills_are_served(metrics):
    guard = Guard()
    metrics.refresh(0.0, [_workload("r-a1-r0"), _workload("r-a1-r1"), _workload(None, "t1")], True, guard, 3)
    metrics.on_kill(m.KillReport(node_id="node-7", time=0, trigger="memory.high", usage_bytes=1, limit_bytes=1,
                                 node_total_bytes=1, target_bytes=1, policy="p", considered=[], selected=["x"],
                                 reason="over the limit"))
    s = _scrape(metrics.url)
    node = ("node", "node-7")
    assert s[("outlast_node_workers", (("kind", "worker"), node))] == 2
    assert s[("outlast_node_workers", (("kind", "task"), node))] == 1
    assert s[("outlast_node_fork_server_ready", (node,))] == 1
    assert s[("outlast_node_cgroup_memory_bytes", (("cgroup", "user"), node))] == 800
    assert s[("outlast_node_cgroup_memory_bytes", (("cgroup", "user/workers/r-a1-r1"), node))] == 500
    assert s[("outlast_node_memory_kills_total", (node, ("reason", "memory.high")))] == 1
    assert s[("outlast_node_output_lines_skipped_total", (node,))] == 3
    metrics.refresh(5.0, [_workload("r-a1-r0")], True, guard, 3)
    s = _scrape(metrics.url)
    assert ("outlast_node_cgroup_memory_bytes", (("cgroup", "user/workers/r-a1-r1"), node)) not in s
    assert s[("outlast_node_workers", (("kind", "worker"), node))] == 1


def test_the_endpoint_is_off_without_a_port_and_on_loopback_unless_told():
    assert endpoint(None) is None and endpoint_from_env("OUTLAST_METRICS_PORT", {}) is None
    assert endpoint_from_env("OUTLAST_METRICS_PORT", {"OUTLAST_METRICS_PORT": "9400"}) == Endpoint("127.0.0.1", 9400)
    assert endpoint("0", "0.0.0.0") == Endpoint("0.0.0.0", 0)
    with pytest.raises(MetricsError, match="must be a port number"):
        endpoint("ninety")
    with pytest.raises(MetricsError, match="between 0 and 65535"):
        endpoint(70000)


def test_a_port_taken_is_refused_with_what_to_do(metrics):
    port = int(metrics.url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(MetricsError, match="choose another port"):
        NodeMetrics("node-8", Endpoint("127.0.0.1", port))


def test_outlast_start_passes_its_metrics_flags_to_the_agent(monkeypatch):
    from outlast.agent.__main__ import metrics_args
    from outlast.cli.main import build_parser

    monkeypatch.delenv("OUTLAST_METRICS_PORT", raising=False)
    assert metrics_args(build_parser().parse_args(["start"])) == []
    args = build_parser().parse_args(["start", "--metrics-port", "9400", "--metrics-host", "0.0.0.0"])
    assert metrics_args(args) == ["--metrics-port", "9400", "--metrics-host", "0.0.0.0"]
