"""A node's Prometheus metrics (`outlast start --metrics-port`, `$OUTLAST_METRICS_PORT`).

The agent's loop sets them from what it already holds (its workloads, the fork server, the
memory guard's readings and kills); the library's HTTP thread only reads them, so nothing here
reaches into the agent from another thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from outlast.metrics import Endpoint, prometheus, serve
from outlast.protocol import messages as m

REFRESH_S = 1.0  # cgroup readings at most this often


class NodeMetrics:
    def __init__(self, node_id: str, where: Endpoint) -> None:
        client = prometheus()
        self.registry = client.CollectorRegistry()
        r, node = self.registry, ["node"]
        self.node_id = node_id
        self.workers = client.Gauge("outlast_node_workers", "Workloads alive on the node, by kind (worker, task)",
                                    node + ["kind"], registry=r)
        self.fork_server_ready = client.Gauge("outlast_node_fork_server_ready",
                                              "1 once the fork server has imported its modules", node, registry=r)
        self.cgroup_memory = client.Gauge(
            "outlast_node_cgroup_memory_bytes",
            "Memory charged to the node's cgroups (system, user) and to each workload's leaf (isolation on)",
            node + ["cgroup"], registry=r)
        self.memory_limit = client.Gauge("outlast_node_workload_memory_limit_bytes",
                                         "What workloads may use together (isolation on)", node, registry=r)
        self.kills = client.Counter("outlast_node_memory_kills_total",
                                    "Workloads killed by the memory policy, by what set it off",
                                    node + ["reason"], registry=r)
        self.output_skipped = client.Counter("outlast_node_output_lines_skipped_total",
                                             "Worker output lines not forwarded (written faster than read)",
                                             node, registry=r)
        self._skipped_seen = 0
        self._next_refresh = float("-inf")
        self._leaves: set[str] = set()
        self.server, self.url = serve(self.registry, where)

    def on_kill(self, report: m.KillReport) -> None:
        self.kills.labels(self.node_id, report.trigger).inc()

    def refresh(self, now: float, workloads: Iterable[Any], fork_server_ready: bool, guard: Any,
                output_skipped: int) -> None:
        """Called every turn of the agent's loop; reads the cgroups at most every REFRESH_S."""
        if output_skipped > self._skipped_seen:
            self.output_skipped.labels(self.node_id).inc(output_skipped - self._skipped_seen)
            self._skipped_seen = output_skipped
        if now < self._next_refresh:
            return
        self._next_refresh = now + REFRESH_S
        workloads = list(workloads)
        tasks = sum(1 for w in workloads if w.task_id)
        self.workers.labels(self.node_id, "worker").set(len(workloads) - tasks)
        self.workers.labels(self.node_id, "task").set(tasks)
        self.fork_server_ready.labels(self.node_id).set(1 if fork_server_ready else 0)
        if guard is None:
            return
        info = guard.info()
        self.cgroup_memory.labels(self.node_id, "system").set(info.system_memory)
        self.cgroup_memory.labels(self.node_id, "user").set(info.user_memory)
        self.memory_limit.labels(self.node_id).set(info.user_limit)
        leaves = {w.leaf for w in workloads if w.leaf}
        for leaf in leaves:
            self.cgroup_memory.labels(self.node_id, f"user/workers/{leaf}").set(guard.leaf_memory(leaf))
        for gone in self._leaves - leaves:  # a series per live leaf only
            self.cgroup_memory.remove(self.node_id, f"user/workers/{gone}")
        self._leaves = leaves

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
