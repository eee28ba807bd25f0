"""`outlast slurm [options] -- CMD ...`: run CMD as the driver of an outlast cluster made of this Slurm job.

The form follows `srun` and `torchrun`: options of ours, then `--`, then the command as it
would be typed alone, so nothing in it needs quoting and any program can be the driver.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("slurm", help="inside a Slurm job: make its nodes a cluster and run a driver on it",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--failure-domain-feature", default="", metavar="PREFIX",
                   help="a node's Slurm feature starting with PREFIX (e.g. rack_) is its failure domain")
    p.add_argument("--failure-domain-switch", action="store_true",
                   help="a node's leaf switch in Slurm's topology (topology/tree) is its failure domain")
    p.add_argument("--preload", default=None,
                   help="comma-separated modules every node's fork server imports (default: torch, if installed)")
    p.add_argument("--join-timeout", type=float, default=180.0, help="seconds to wait for every node to join")
    p.add_argument("--node-poll-interval", type=float, default=1.0,
                   help="seconds between looks at `scontrol show node` for drains by an administrator")
    p.add_argument("--etcd", default=None, metavar="URL[,URL...]",
                   help="keep the cluster in etcd: no node is the one head; the head role is elected")
    p.add_argument("--etcd-cacert", default=None, metavar="FILE", help="etcd's CA certificate (TLS)")
    p.add_argument("--etcd-cert", default=None, metavar="FILE", help="the agents' client certificate for etcd")
    p.add_argument("--etcd-key", default=None, metavar="FILE", help="the key of --etcd-cert")
    p.add_argument("--etcd-user", default=None, help="etcd user (its password in $OUTLAST_ETCD_PASSWORD)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...: the driver, e.g. -- python train.py")
    p.set_defaults(func=cmd_slurm)


def cmd_slurm(args: argparse.Namespace) -> int:
    from outlast.slurm.allocation import SlurmEnvError, allocation_from_env, not_on_first_node
    from outlast.slurm.launcher import Options, run

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("outlast slurm: give the driver's command after --, e.g. `outlast slurm -- python train.py`",
              file=sys.stderr)
        return 2
    try:
        alloc = allocation_from_env(os.environ)
    except SlurmEnvError as e:
        print(f"outlast slurm: {e}", file=sys.stderr)
        return 2
    why = not_on_first_node(os.environ, alloc)
    if why:
        print(f"outlast slurm: {why}", file=sys.stderr)
        return 2
    if not (args.node_poll_interval > 0 and args.join_timeout > 0):
        print("outlast slurm: --node-poll-interval and --join-timeout must be > 0", file=sys.stderr)
        return 2
    etcd = None
    if args.etcd is not None:
        from outlast.cluster.etcd_store import EtcdConfig

        try:
            etcd = EtcdConfig.parse(args.etcd, args.etcd_cacert, args.etcd_cert, args.etcd_key, args.etcd_user,
                                    os.environ.get("OUTLAST_ETCD_PASSWORD"),
                                    int(os.environ.get("OUTLAST_ETCD_LEASE_TTL_S", "3")))
        except ValueError as e:
            print(f"outlast slurm: {e}", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s outlast-slurm %(levelname)s %(message)s")
    preload = args.preload if args.preload is not None else _default_preload()
    return run(alloc, Options(command=command, failure_domain_feature=args.failure_domain_feature,
                              failure_domain_switch=args.failure_domain_switch, preload=preload,
                              join_timeout_s=args.join_timeout, poll_interval_s=args.node_poll_interval,
                              etcd=etcd))


def _default_preload() -> str:
    from outlast.client.preload import default_preload

    return ",".join(default_preload())
