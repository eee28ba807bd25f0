"""`python -m outlast.agent`: run a node agent in the foreground."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import uuid
from typing import TYPE_CHECKING

# Only what starting the fork server takes is imported here: the agent's own modules (a tenth of a second and
# more) are imported in main() once the server runs, beside its imports (torch's: seconds) on another core.
from outlast.agent.forkserver import ForkServer
from outlast.agent.worker_user import resolve as resolve_worker_user
from outlast.procutil import die_with_parent
from outlast.isolation.config import IsolationConfig, add_arguments, config_from_args
from outlast.isolation.errors import IsolationError
from outlast.metrics import DEFAULT_HOST, HOST_VAR, NODE_PORT_VAR
from outlast.runenv import read_secrets, secrets_in, without_secrets, write_secrets
from outlast.trace import mark

if TYPE_CHECKING:
    from outlast.agent.agent import NodeSpec
    from outlast.cluster.etcd_store import EtcdConfig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m outlast.agent")
    p.add_argument("--node-id", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--preload", default="", help="comma-separated modules the fork server imports")
    p.add_argument("--ready-fd", type=int, default=None, help="write the address to this fd once listening")
    p.add_argument("--secrets-fd", type=int, default=None,
                   help="read the cluster key and etcd's password from this pipe (JSON), never from the environment")
    p.add_argument("--embedded", action="store_true", help="die with the parent process (a driver)")
    p.add_argument("--standby-fd", type=int, default=None,
                   help="a standby (outlast/client/embedded.py): start the fork server, then wait for a line on "
                        "this fd before binding; exit at its end of file")
    p.add_argument("--die-with-parent", action="store_true", help="die with the parent process (tests)")
    p.add_argument("--node-file", action="store_true", help="publish the address for drivers and the CLI")
    add_arguments(p)
    p.add_argument("--preemption-watchers", default="",
                   help="comma-separated clouds whose preemption notices drain this node: aws, gcp, azure")
    p.add_argument("--metadata-url", action="append", default=[], metavar="CLOUD=URL",
                   help="a cloud's metadata server, when not the standard address")
    add_cluster_arguments(p)
    add_metrics_arguments(p)
    args = p.parse_args(argv)
    mark("agent.main")
    secrets = read_secrets(args.secrets_fd) if args.secrets_fd is not None else {}
    if secrets_in(os.environ):
        exec_without_secrets(sys.argv[1:] if argv is None else argv, {**secrets_in(os.environ), **secrets})

    logging.basicConfig(level=logging.INFO, format="%(asctime)s outlast-agent %(levelname)s %(message)s")
    if args.embedded:
        die_with_parent()
    preload = [s for s in args.preload.split(",") if s]
    forks = fork_server_ahead(args, preload)

    from outlast.agent.agent import Agent
    from outlast.client.discovery import NodeFile, pid_namespace, remove_node_file, write_node_file
    from outlast.cluster.etcd_store import StoreUnavailable
    from outlast.identity import this_process
    from outlast.metrics import MetricsError, endpoint
    from outlast.protocol.auth import AuthError

    node_id = args.node_id or uuid.uuid4().hex[:8]
    try:
        spec = spec_from_args(args, secrets)
        isolation = config_from_args(args)
        where = endpoint(args.metrics_port, args.metrics_host)
        if args.standby_fd is not None:
            forks = wait_as_standby(args.standby_fd, preload, spec, isolation)
        agent = Agent(node_id, args.host, args.port, preload, isolation=isolation, spec=spec, forks=forks)
    except (IsolationError, AuthError, ValueError, MetricsError, StoreUnavailable) as e:
        if forks is not None:  # the server started ahead (closed already if Agent() had it: closing again is nothing)
            forks.close()
        logging.error("%s", e)
        sys.exit(3)
    if where is not None:
        try:
            from outlast.agent.metrics import NodeMetrics

            agent.metrics = NodeMetrics(node_id, where)
        except MetricsError as e:
            logging.error("%s", e)
            agent.close()
            sys.exit(3)
        logging.info("serving the node's metrics at %s", agent.metrics.url)
    # A driver stops its embedded node at once; a standalone node drains first, so that its
    # runs can save a checkpoint (OUTLAST_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, default 30 s).
    signal.signal(signal.SIGTERM, agent.request_stop if args.embedded else agent.request_graceful_stop)
    signal.signal(signal.SIGINT, agent.request_stop)
    if args.die_with_parent:
        # Not PR_SET_PDEATHSIG: that fires when the parent *thread* ends, and a test may start
        # nodes from a thread that ends long before the test does.
        agent.parent_pid = os.getppid()
    if args.preemption_watchers:
        urls = dict(item.split("=", 1) for item in args.metadata_url if "=" in item)
        agent.watch_cloud_notices([k for k in args.preemption_watchers.split(",") if k], urls)
    if args.node_file:
        write_node_file(NodeFile(address=agent.address, pid=os.getpid(), node_id=node_id, process=this_process(),
                                 pid_namespace=pid_namespace()))
    mark("agent.listening", address=agent.address)
    if args.ready_fd is not None:
        os.write(args.ready_fd, (agent.address + "\n").encode())
        os.close(args.ready_fd)
    try:
        agent.serve()
    finally:
        if args.node_file:
            remove_node_file(os.getpid())
    sys.exit(0)


def fork_server_ahead(args: argparse.Namespace, preload: list[str]) -> ForkServer | None:
    """The node's fork server, started before the agent's own imports; None where it must wait for the agent: a
    standby's starts in wait_as_standby, and with isolation on the server starts in the cgroup the agent moves
    into first. None too when a setting is wrong: the agent's start says what."""
    if args.standby_fd is not None:
        return None
    try:
        isolation = config_from_args(args)
        worker_user = resolve_worker_user(args.worker_user) if args.worker_user else None
    except (IsolationError, ValueError):
        return None
    return None if isolation and isolation.enable_resource_isolation else ForkServer(preload, worker_user)


def wait_as_standby(fd: int, preload: list[str], spec: NodeSpec, isolation: IsolationConfig | None,
                    ) -> ForkServer | None:
    """Until the driver's word: the fork server imports its modules meanwhile, so that taking over costs a
    bind, not a Python start and `import torch`. With isolation on, the fork server must start inside the
    agent's cgroup, which the agent moves into once it takes over: then only the imports are done ahead."""
    forks = None if isolation and isolation.enable_resource_isolation else ForkServer(preload, spec.worker_user)
    mark("agent.standby_waiting")
    try:
        word = os.read(fd, 16)
    except OSError:
        word = b""
    os.close(fd)
    if not word:  # the driver stopped, or dropped its standby
        if forks is not None:
            forks.close()
        sys.exit(0)
    mark("agent.standby_go")
    return forks


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", dest="head_address", default=None, metavar="HOST:PORT",
                   help="join the cluster whose head listens there (default: be a head)")
    p.add_argument("--cluster-key", default=None, metavar="FILE",
                   help="the cluster key file (default: $OUTLAST_HOME/cluster.key; a head creates it)")
    p.add_argument("--node-ip", default=None, help="this node's address as other nodes reach it")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs workloads may use (default: all)")
    p.add_argument("--num-gpus", type=float, default=None, help="GPUs workloads may use (default: 0)")
    p.add_argument("--memory", default=None, help="memory workloads may use, e.g. 16GiB (default: all)")
    p.add_argument("--resources", default="", metavar="NAME=AMOUNT,...", help="custom resources, e.g. TPU=4")
    p.add_argument("--labels", default="", metavar="KEY=VALUE,...", help="labels of this node")
    p.add_argument("--failure-domain", default="",
                   help="a TPU slice, a rack: draining one node of the domain drains all of it")
    p.add_argument("--etcd", default=None, metavar="URL[,URL...]",
                   help="keep the cluster in etcd at these client URLs: no head process; the head role is elected "
                        "and passes on when its agent dies (pip install 'outlast[etcd]'); replaces --address")
    p.add_argument("--etcd-cacert", default=None, metavar="FILE", help="etcd's CA certificate (TLS)")
    p.add_argument("--etcd-cert", default=None, metavar="FILE", help="this client's certificate for etcd (TLS)")
    p.add_argument("--etcd-key", default=None, metavar="FILE", help="the key of --etcd-cert")
    p.add_argument("--etcd-user", default=None, help="etcd user (its password in $OUTLAST_ETCD_PASSWORD)")
    p.add_argument("--checkpoint-memory", default=None, metavar="SIZE",
                   help="RAM this node keeps checkpoint copies in, its own ranks' and a peer's, e.g. 8GiB; 0 turns "
                        "the memory tier off (default: 2GiB, or an eighth of the memory of a node under 16GiB; with "
                        "--enable-resource-isolation, reserved beside the system's memory, and the default never "
                        "more than leaves the workloads 64MiB)")
    p.add_argument("--worker-user", default=None, metavar="USER",
                   help="run workers as USER (the agent runs as root): they cannot read the node's state directory "
                        "(cluster key, node file, other runs' output) nor signal the agent")
    p.add_argument("--node-timeout", type=float, default=float(os.environ.get("OUTLAST_NODE_TIMEOUT_S", "5")),
                   help="seconds of silence after which the head declares a node dead (OUTLAST_NODE_TIMEOUT_S)")


def add_metrics_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", default=os.environ.get(NODE_PORT_VAR) or None, metavar="PORT",
                   help=f"serve the node's Prometheus metrics on this port, 0 for any free one (${NODE_PORT_VAR}; "
                        "default: off)")
    p.add_argument("--metrics-host", default=os.environ.get(HOST_VAR) or None, metavar="HOST",
                   help=f"the address the metrics listen on (${HOST_VAR}; default: {DEFAULT_HOST}, loopback only)")


def metrics_args(args: argparse.Namespace) -> list[str]:
    out = ["--metrics-port", str(args.metrics_port)] if args.metrics_port is not None else []
    return out + (["--metrics-host", args.metrics_host] if args.metrics_host else [])


def exec_without_secrets(argv: list[str], secrets: dict[str, str]) -> None:
    """Become this same agent again, its secrets in a pipe and none in its environment.

    A process's environment block (`/proc/PID/environ`) is fixed when it is exec'd, and the fork
    server and its workers are this process's descendants, of the same user: a secret that came
    in the environment (a systemd unit's Environment=, a Slurm step's) must leave it by an exec."""
    i = argv.index("--secrets-fd") if "--secrets-fd" in argv else -1
    if i >= 0:
        argv = argv[:i] + argv[i + 2:]
    fd = write_secrets(secrets)
    os.execve(sys.executable, [sys.executable, "-m", "outlast.agent", *argv, "--secrets-fd", str(fd)],
              without_secrets(os.environ))


def spec_from_args(args: argparse.Namespace, secrets: dict[str, str] | None = None) -> NodeSpec:
    """Raises ValueError or AuthError with a message that says what to fix."""
    from outlast.agent.agent import NodeSpec, default_resources
    from outlast.agent.gpus import dev_names, node_gpu_ids
    from outlast.client.discovery import cluster_key_path
    from outlast.protocol.auth import SECRET_ENV, ClusterKey
    from outlast.protocol.transport import route_ip

    secrets = secrets or {}
    from outlast.isolation.units import parse_bytes

    resources = default_resources()
    if args.num_cpus is not None:
        resources["CPU"] = _non_negative("--num-cpus", args.num_cpus)
    if args.num_gpus is not None:
        resources["GPU"] = float(len(node_gpu_ids(_non_negative("--num-gpus", args.num_gpus), os.environ, dev_names())))
    if args.memory is not None:
        resources["memory"] = float(parse_bytes(args.memory, "--memory"))
    for name, amount in _pairs("--resources", args.resources).items():
        try:
            resources[name] = _non_negative(f"--resources {name}", float(amount))
        except ValueError:
            raise ValueError(f"--resources {name}={amount}: the amount must be a number >= 0") from None
    head = args.head_address
    etcd = etcd_from_args(args, secrets.get("OUTLAST_ETCD_PASSWORD"))
    if etcd is not None and head is not None:
        raise ValueError("--etcd and --address both name a cluster: with --etcd, give only the etcd URLs")
    if head is not None and "://" not in head:
        head = f"tcp://{head}"
    key_file = args.cluster_key or os.environ.get("OUTLAST_CLUSTER_KEY") or str(cluster_key_path())
    # An embedded node's private key, from its driver; or a node's whose supervisor holds the key.
    key = ClusterKey(secrets[SECRET_ENV].encode()) if secrets.get(SECRET_ENV) else None
    if key is None and head is None and not os.path.exists(key_file):
        key = ClusterKey.generate()  # a new cluster: its head makes the key
        key.save(key_file)
        logging.info("wrote the cluster key to %s; other nodes and drivers need a copy", key_file)
    elif key is None:
        key = ClusterKey.load(key_file)
    node_ip = args.node_ip or (args.host if args.host not in ("0.0.0.0", "*") else route_ip(head))
    tier = None if args.checkpoint_memory is None else parse_bytes(args.checkpoint_memory, "--checkpoint-memory")
    worker_user = resolve_worker_user(args.worker_user) if args.worker_user else None
    return NodeSpec(resources=resources, labels=_pairs("--labels", args.labels), failure_domain=args.failure_domain,
                    node_ip=node_ip, head_address=head, key=key, node_timeout_s=args.node_timeout, etcd=etcd,
                    checkpoint_memory=tier, embedded=bool(getattr(args, "embedded", False)), worker_user=worker_user)


def etcd_from_args(args: argparse.Namespace, password: str | None) -> EtcdConfig | None:
    from outlast.cluster.etcd_store import EtcdConfig

    if args.etcd is None:
        return None
    return EtcdConfig.parse(args.etcd, args.etcd_cacert, args.etcd_cert, args.etcd_key, args.etcd_user, password,
                            int(os.environ.get("OUTLAST_ETCD_LEASE_TTL_S", "3")))


def _non_negative(flag: str, value: float) -> float:
    if not value >= 0:
        raise ValueError(f"{flag} must be >= 0, got {value}")
    return float(value)


def _pairs(flag: str, text: str) -> dict[str, str]:
    out = {}
    for item in (t for t in text.split(",") if t.strip()):
        if "=" not in item:
            raise ValueError(f"{flag}: {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out




if __name__ == "__main__":
    main()
