"""`python -m outlast.slurm.node`: what `srun` runs on a node of the job: that node's agent.

It runs as a step on the node, so it reads what Slurm gave the job *there* (the GPUs of the
step's GRES), keeps the agent's state in a directory of its own (mode 0700), and becomes
`python -m outlast.agent`, which stops at once on the SIGTERM that ends a step. The cluster key
comes in the step's environment ($OUTLAST_CLUSTER_SECRET, carried by Slurm), never in a file
on the node.
"""

from __future__ import annotations

import argparse
import os
import sys

from outlast.slurm.allocation import gpus_on_node


def agent_argv(args: argparse.Namespace, gpus: int) -> list[str]:
    argv = [sys.executable, "-m", "outlast.agent", "--embedded", "--node-file", "--node-id", args.node_id,
            "--host", args.host, "--num-cpus", str(args.num_cpus), "--num-gpus", str(gpus),
            "--preload", args.preload, "--node-timeout", str(args.node_timeout)]
    if args.address:
        argv += ["--address", args.address]
    if args.failure_domain:
        argv += ["--failure-domain", args.failure_domain]
    if args.labels:
        argv += ["--labels", args.labels]
    return argv + etcd_argv(os.environ)


def etcd_argv(environ) -> list[str]:
    """The etcd flags from the step's environment (`outlast slurm --etcd` puts them there; the password
    stays in $OUTLAST_ETCD_PASSWORD, where the agent reads it)."""
    if not environ.get("OUTLAST_ETCD"):
        return []
    argv = ["--etcd", environ["OUTLAST_ETCD"]]
    for flag, name in (("--etcd-cacert", "CACERT"), ("--etcd-cert", "CERT"), ("--etcd-key", "KEY"),
                       ("--etcd-user", "USER")):
        if environ.get(f"OUTLAST_ETCD_{name}"):
            argv += [flag, environ[f"OUTLAST_ETCD_{name}"]]
    return argv


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m outlast.slurm.node")
    p.add_argument("--node-id", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--num-cpus", type=float, required=True)
    p.add_argument("--home", required=True, help="this node's private state directory")
    p.add_argument("--address", default="", help="the head to join (none: be the head)")
    p.add_argument("--failure-domain", default="")
    p.add_argument("--labels", default="")
    p.add_argument("--preload", default="")
    p.add_argument("--node-timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    if not os.environ.get("OUTLAST_CLUSTER_SECRET"):
        sys.exit("outlast.slurm.node: no cluster key in $OUTLAST_CLUSTER_SECRET; `outlast slurm` starts this")
    os.makedirs(args.home, mode=0o700, exist_ok=True)
    os.chmod(args.home, 0o700)
    os.environ["OUTLAST_HOME"] = args.home
    argv = agent_argv(args, gpus_on_node(os.environ))
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
