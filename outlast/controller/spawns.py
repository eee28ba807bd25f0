"""The message that starts ranks of an attempt on a node: a new attempt's, and a live recovery's replacement."""

from __future__ import annotations

from outlast.controller.core_state import CoreState
from outlast.controller.group import Spawn
from outlast.controller.types import AttemptState
from outlast.protocol import messages as m


def spawn(c: CoreState, a: AttemptState, node_id: str, specs: list[m.WorkerSpec], env: dict[str, str]) -> Spawn:
    return Spawn(node_id, m.SpawnWorkers(
        run_id=c.run_id, attempt=a.number, controller_address=c.address, workers=specs,
        payload=c.plan.payload, env=env, cwd=c.plan.cwd, sys_path=c.plan.sys_path,
        run_name=c.plan.name, restore_checkpoint=a.restore, resources=c.plan.per_worker,
        run_key=c.run_key, forward_output=c.plan.forward_output,
        agent_pid=c.nodes.nodes[node_id].agent_pid,
    ))
