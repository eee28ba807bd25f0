"""Slurm's own commands, as the job runs them (effects): scontrol, srun."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping

from outlast.slurm.scontrol import JobInfo, NodeState, job_info, leaf_switches, node_states, partition_grace_s

log = logging.getLogger("outlast.slurm")


class SlurmCommandError(RuntimeError):
    pass


class Slurm:
    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)

    def _run(self, cmd: list[str], timeout_s: float = 15.0) -> str:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=self.env)
        except FileNotFoundError:
            raise SlurmCommandError(f"{cmd[0]} is not installed here: `outlast slurm` runs inside a Slurm "
                                    "allocation, where Slurm's commands are on the PATH") from None
        except subprocess.TimeoutExpired:
            raise SlurmCommandError(f"`{' '.join(cmd)}` did not answer within {timeout_s:.0f} s") from None
        if out.returncode != 0:
            raise SlurmCommandError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.stdout.strip()}")
        return out.stdout

    def show_nodes(self, names: list[str]) -> list[NodeState]:
        return node_states(self._run(["scontrol", "show", "node", "-o", ",".join(names)]))

    def show_job(self, job_id: str) -> JobInfo:
        return job_info(self._run(["scontrol", "show", "job", "-o", job_id]))

    def grace_s(self, partition: str) -> float:
        return partition_grace_s(self._run(["scontrol", "show", "partition", "-o", partition])) if partition else 0.0

    def leaf_switches(self) -> dict[str, str]:
        """Empty without a topology (TopologyPlugin=topology/none makes scontrol say so and fail)."""
        try:
            return leaf_switches(self._run(["scontrol", "show", "topology"]))
        except SlurmCommandError as e:
            log.warning("no Slurm topology to take failure domains from: %s", e)
            return {}

    def requeue(self, job_id: str) -> None:
        self._run(["scontrol", "requeue", job_id])

    def srun_on(self, node: str, argv: list[str], extra_env: Mapping[str, str]) -> subprocess.Popen:
        """One task on `node`, a step of its own (a node that fails ends only its step); --overlap: the
        agent shares the node's CPUs with the workers it starts."""
        cmd = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", "--kill-on-bad-exit=0", "--quiet",
               f"--job-name=outlast-agent-{node}", *argv]
        return subprocess.Popen(cmd, env={**self.env, **extra_env}, stdin=subprocess.DEVNULL,
                                start_new_session=True)
