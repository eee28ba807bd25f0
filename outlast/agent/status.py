"""`outlast status`: what a node says about itself (and, on the head, about the cluster)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import psutil

from outlast.protocol import messages as m

if TYPE_CHECKING:
    from outlast.agent.agent import Agent


def node_status(agent: Agent) -> m.StatusReply:
    g = agent.guard
    infos = []
    for w in agent.sup.workloads.values():
        try:
            rss = psutil.Process(w.pid).memory_info().rss
        except psutil.Error:
            rss = 0
        infos.append(m.WorkerInfo(run_id=w.run_id, attempt=w.attempt, rank=w.rank, pid=w.pid, rss_bytes=rss,
                                  task_id=w.task_id, memory_bytes=g.leaf_memory(w.leaf) if g and w.leaf else 0,
                                  resources=w.resources))
    resources = agent.spec.resources
    return m.StatusReply(
        node_id=agent.node_id, pid=os.getpid(), address=agent.address, started_at=agent.started_at,
        runs=sorted(agent.sup.runs), workers=infos, preload=agent.preload, zygote_ready=agent.forks.ready,
        draining=agent.draining, isolation=g.info() if g else None, recent_kills=g.recent_kills() if g else [],
        capacity=g.capacity() if g else m.Resources(num_cpus=resources.get("CPU", 0.0),
                                                     memory_bytes=int(resources.get("memory", 0))),
        head_address=agent.role.head_address,
        nodes=agent.role.nodes(agent.me(), agent.clock()) if not agent.role.head_address else [],
        store=agent.role.store_health(),
        run_commits={r.run_id: r.last_commit_at for r in agent.sup.runs.values() if r.last_commit_at is not None},
        run_drain_saves={r.run_id: r.saved_for_drain_at for r in agent.sup.runs.values()
                         if r.saved_for_drain_at is not None},
        metrics_url=agent.metrics.url if agent.metrics is not None else "",
        fork_server_pid=agent.forks.pid,
        fork_server_standby_pid=agent.forks.standby_pid,
        fork_server_cuda=ready.cuda_initialized if (ready := agent.fork_server_ready) is not None else "",
        gpus={i: [f"{k[0]}/a{k[1]}/r{k[2]}" for k, shares in agent.core.gpus.held.items() if i in shares]
              for i in agent.core.gpus.ids},
    )
