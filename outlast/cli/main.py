"""`outlast start | stop | status`: a persistent node agent on this machine."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import time
from pathlib import Path

import zmq

from outlast.agent.__main__ import add_cluster_arguments, add_metrics_arguments, metrics_args
from outlast.cli.store_status import render_store
from outlast.client.discovery import (
    AgentUnavailable, cluster_key_path, elsewhere_message, find_running_agent, node_elsewhere, node_file_path,
    published_node, read_node_file, request, start_agent_process, state_dir,
)
from outlast.cli.dashboard.command import add_parser as add_dashboard_parser
from outlast.cli.drain import add_parser as add_drain_parser
from outlast.cli.run_script import add_parser as add_run_script_parser
from outlast.cli.documents import StatusDocument, to_json
from outlast.cli.runs import add_parser as add_runs_parser
from outlast.cli.slurm import add_parser as add_slurm_parser
from outlast.client.preload import default_preload
from outlast.isolation.config import add_arguments, config_from_args
from outlast.isolation.errors import IsolationError
from outlast.isolation.policy import render_report
from outlast.isolation.units import format_bytes
from outlast.protocol import messages as m
from outlast.protocol.auth import AuthError, ClusterKey
from outlast.identity import still_running
from outlast.statedir import UnsafeStateError


def _default_preload() -> str:
    return ",".join(default_preload())


def cmd_start(args: argparse.Namespace) -> int:
    running = published_node()
    if running is not None:
        print(f"an outlast node is already running at {running.address} (pid {running.pid}); "
              "run `outlast stop` first", file=sys.stderr)
        return 1
    try:
        isolation = config_from_args(args)
        if isolation.enable_resource_isolation:
            _check_isolation(isolation)
    except IsolationError as e:
        print(f"could not start the node: {e}", file=sys.stderr)
        return 2
    agent_args = ["--node-file", "--host", args.host, "--port", str(args.port), "--preload", args.preload]
    if args.node_id:
        agent_args += ["--node-id", args.node_id]
    agent_args += isolation.to_args() + metrics_args(args)
    if args.preemption_watchers:
        unknown = sorted(set(k for k in args.preemption_watchers.split(",") if k) - {"aws", "gcp", "azure"})
        if unknown:
            print(f"--preemption-watchers: unknown cloud {', '.join(unknown)}; choose among aws, gcp, azure",
                  file=sys.stderr)
            return 2
        agent_args += ["--preemption-watchers", args.preemption_watchers]
    for url in args.metadata_url:
        agent_args += ["--metadata-url", url]
    key_file = _key_file(args)
    agent_args += _cluster_args(args, key_file)
    if args.block:
        from outlast.agent.__main__ import main as agent_main

        agent_main(agent_args)
        return 0
    log_path = state_dir() / "agent.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_start = log_path.stat().st_size if log_path.exists() else 0
    try:
        # A member may wait for its head's handshake and answer (10 s each) before it listens.
        proc, address = start_agent_process([], embedded=False, extra_args=agent_args, log_path=log_path,
                                            timeout_s=60.0)
    except AgentUnavailable as e:
        why = _start_errors(log_path, log_start)
        joining = f"could not join the cluster whose head is at {args.head_address}" if args.head_address else ""
        print(f"{joining or 'could not start the node'}: {why or e}", file=sys.stderr)
        if why:
            print(f"(the agent exited; its log: {log_path})", file=sys.stderr)
        return 1
    key = ClusterKey.load(key_file) if key_file else ClusterKey.from_env()
    local_key = _keep_key_for_local_tools(key_file, key)
    # Return once the fork server has its modules imported: a fit() right after this must not
    # pay for them.
    ready = _wait_for_fork_server(address, key, timeout_s=180.0)
    print(f"outlast node started at {address} (pid {proc.pid}); log: {log_path}")
    if not ready:
        print("its fork server is still importing its modules; `outlast status` shows when it is ready")
    if args.head_address:
        print(f"joined the cluster whose head is at {_head_of_new_member(address, key, args.head_address)}")
    elif args.etcd:
        print(f"joined the cluster kept in etcd at {args.etcd}; on other machines, with a copy of the key: "
              f"outlast start --etcd {args.etcd} --cluster-key {key_file or 'FILE'}; drivers there need "
              f"OUTLAST_ETCD={args.etcd}")
    else:
        _print_join_help(address, args.host, key_file)
    if local_key:
        print(local_key)
    print("Trainer.fit() on this machine now uses it; `outlast stop` stops it.")
    return 0


def _key_file(args: argparse.Namespace) -> str | None:
    """The key file the agent will use, absolute (None: the key is in $OUTLAST_CLUSTER_SECRET)."""
    if os.environ.get("OUTLAST_CLUSTER_SECRET"):
        return None
    return os.path.abspath(args.cluster_key or os.environ.get("OUTLAST_CLUSTER_KEY") or cluster_key_path())


def _cluster_args(args: argparse.Namespace, key_file: str | None) -> list[str]:
    out = ["--node-timeout", str(args.node_timeout)]
    if key_file is not None:
        out += ["--cluster-key", key_file]
    for flag, value in (("--address", args.head_address), ("--node-ip", args.node_ip),
                        ("--num-cpus", args.num_cpus), ("--num-gpus", args.num_gpus), ("--memory", args.memory),
                        ("--resources", args.resources), ("--labels", args.labels),
                        ("--failure-domain", args.failure_domain), ("--etcd", args.etcd),
                        ("--etcd-cacert", args.etcd_cacert), ("--etcd-cert", args.etcd_cert),
                        ("--etcd-key", args.etcd_key), ("--etcd-user", args.etcd_user),
                        ("--checkpoint-memory", args.checkpoint_memory), ("--worker-user", args.worker_user)):
        if value not in (None, ""):
            out += [flag, str(value)]
    return out


def _start_errors(log_path: Path, start: int) -> str:
    """Why the agent exited during start-up: the errors it logged in this start's part of its log."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line.split(" ERROR ", 1)[1] for line in lines if " ERROR " in line]
    if errors:
        return "; ".join(errors)
    return "\n".join(lines[-5:])  # a crash: its traceback's last lines


def _keep_key_for_local_tools(key_file: str | None, key: ClusterKey | None) -> str:
    """Drivers and the CLI on this machine look for the key in $OUTLAST_HOME/cluster.key: put it there."""
    local = cluster_key_path()
    if key_file is None or key is None or os.path.abspath(key_file) == os.path.abspath(local):
        return ""
    replaced = local.exists()
    if replaced:
        try:
            if ClusterKey.load(local).secret == key.secret:
                return ""
        except AuthError:
            pass  # not a key: replace it
    key.save(local)
    return (f"copied the cluster key to {local}{' (replacing the key there)' if replaced else ''}, where drivers "
            "and the CLI on this machine look for it")


def _head_of_new_member(address: str, key: ClusterKey | None, given: str) -> str:
    ctx = zmq.Context()
    try:
        pong = request(ctx, address, m.Ping(), timeout_s=5.0, key=key)
        return pong.head_address if isinstance(pong, m.Pong) and pong.head_address else given
    except AgentUnavailable:
        return given
    finally:
        ctx.term()


def _print_join_help(address: str, host: str, key_file: str | None) -> None:
    where = address.split("://", 1)[-1]
    key = key_file or "FILE (a file holding $OUTLAST_CLUSTER_SECRET)"
    print(f"this node is the head of a new cluster; its key: {key}")
    print("to add another machine, copy the key file there and run on it:")
    print(f"  outlast start --address {where} --cluster-key {key}")
    if _is_loopback(host):
        print(f"note: this head listens on {host}, so only this machine can join it; to let other machines "
              "join, `outlast stop` and start it again with `--host 0.0.0.0`")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _wait_for_fork_server(address: str, key: ClusterKey | None, timeout_s: float) -> bool:
    ctx = zmq.Context()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                reply = request(ctx, address, m.StatusRequest(), timeout_s=5.0, key=key)
            except AgentUnavailable:
                return False
            if isinstance(reply, m.StatusReply) and reply.zygote_ready:
                return True
            time.sleep(0.05)
        return False
    finally:
        ctx.term()


def _check_isolation(isolation) -> None:
    """Validate here, read-only, so the problems are printed where the user typed the command."""
    from outlast.isolation.detect import detect

    detect("check", isolation.cgroup_path).validate()


def cmd_stop(args: argparse.Namespace) -> int:
    info = read_node_file()
    if info is None:
        print("no outlast node is running on this machine", file=sys.stderr)
        return 1
    if node_elsewhere() is not None:  # its pid is no process of ours: signal nothing, remove nothing
        print(elsewhere_message(info, "stop"), file=sys.stderr)
        return 1
    ours, why = still_running(info.process, info.pid)
    if not ours:  # the agent died without removing its file: its pid may be anyone's now
        node_file_path().unlink(missing_ok=True)
        print(f"no outlast node is running on this machine: {node_file_path()} was stale ({why}); "
              "removed it and signalled nothing", file=sys.stderr)
        return 1
    ctx = zmq.Context()
    try:
        request(ctx, info.address, m.Shutdown(), timeout_s=3.0)
    except AgentUnavailable:
        _signal(info.pid, signal.SIGTERM)
    finally:
        ctx.term()
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline and still_running(info.process, info.pid)[0]:
        time.sleep(0.05)
    if still_running(info.process, info.pid)[0]:
        _signal(info.pid, signal.SIGKILL)
        print(f"the node (pid {info.pid}) did not stop within {args.timeout:.0f} s; killed it")
    node_file_path().unlink(missing_ok=True)
    print(f"stopped the outlast node {info.node_id} (pid {info.pid})")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    ctx = zmq.Context()
    try:
        address = find_running_agent(ctx)
        if address is None:
            elsewhere = node_elsewhere()
            if elsewhere is not None:
                print(elsewhere_message(elsewhere), file=sys.stderr)
                return 1
            print("no outlast node is running on this machine (start one with `outlast start`)")
            return 1
        reply = request(ctx, address, m.StatusRequest(), timeout_s=3.0)
        assert isinstance(reply, m.StatusReply)
        if args.json:
            return _print_status_json(ctx, reply)
        _print_node(reply)
        if reply.store is not None:
            print(render_store(reply.store, time.time()))
            print(f"cluster (the table in etcd): {_summary(reply.nodes)}")
            print(render_nodes(reply.nodes, time.time(), this_node=reply.node_id))
            return 0
        if not reply.head_address:
            print(f"cluster: this node is its head; {_summary(reply.nodes)}")
            print(render_nodes(reply.nodes, time.time()))
            return 0
        print(f"cluster: this node is a member; its head is at {reply.head_address}")
        try:
            table = request(ctx, reply.head_address, m.ListNodes(), timeout_s=3.0)
        except AgentUnavailable as e:
            print(f"the head does not answer, so its node table is unknown: {e}", file=sys.stderr)
            return 1
        assert isinstance(table, m.NodeList)
        print(f"the head's node table (* this node): {_summary(table.nodes)}")
        print(render_nodes(table.nodes, time.time(), this_node=reply.node_id))
        return 0
    except AgentUnavailable as e:
        print(str(e), file=sys.stderr)
        return 1
    finally:
        ctx.term()


def _print_status_json(ctx: zmq.Context, reply: m.StatusReply) -> int:
    nodes, answered = reply.nodes, True
    if reply.head_address:
        try:
            table = request(ctx, reply.head_address, m.ListNodes(), timeout_s=3.0)
            nodes = table.nodes if isinstance(table, m.NodeList) else []
        except AgentUnavailable:
            nodes, answered = [], False
    print(to_json(StatusDocument(node=reply, role="member" if reply.head_address else "head",
                                 head_address=reply.head_address, nodes=nodes, head_answered=answered)))
    return 0 if answered else 1


def _print_node(reply: m.StatusReply) -> None:
    up = time.time() - reply.started_at
    print(f"node {reply.node_id}  pid {reply.pid}  {reply.address}  up {up:.0f} s")
    print(f"fork server: {'ready' if reply.zygote_ready else 'starting'}, preloaded: "
          f"{', '.join(reply.preload) or 'nothing'}")
    print(f"runs: {len(reply.runs)}  workers: {len(reply.workers)}")
    print(f"metrics: {reply.metrics_url or 'off (outlast start --metrics-port PORT turns them on)'}")
    if reply.draining is not None:
        d = reply.draining
        left = f"deadline in {d.deadline_unix_s - time.time():.0f} s" if d.deadline_unix_s else "no deadline"
        print(f"draining: {d.reason} ({d.message or 'no message'}), {left}; takes no new workers")
    iso = reply.isolation
    if iso is None:
        print("resource isolation: off (outlast start --enable-resource-isolation turns it on)")
    else:
        print(f"resource isolation: cgroup v{iso.cgroup_version} at {iso.root}; monitors: {', '.join(iso.monitors)}")
        print(f"  memory: total {format_bytes(iso.total_memory)}, reserved for the system "
              f"{format_bytes(iso.system_reserved_memory)}, workloads' limit {format_bytes(iso.user_limit)}")
        print(f"  cpu: {iso.total_cpus:g} cores, reserved for the system {iso.system_reserved_cpus:g}")
        print(f"  in use: system {format_bytes(iso.system_memory)}, user {format_bytes(iso.user_memory)} "
              f"(anon + shared, as the kill policy counts it: {format_bytes(iso.counted_memory)})")
        print(f"  workers killed for memory: {iso.kills}")
    for w in sorted(reply.workers, key=lambda w: (w.run_id, w.task_id, w.rank)):
        who = f"task {w.task_id}" if w.task_id else f"run {w.run_id}  attempt {w.attempt}  rank {w.rank}"
        mem = f"  memory {format_bytes(w.memory_bytes)}" if iso is not None else ""
        print(f"  {who}  pid {w.pid}  rss {w.rss_bytes / 2**20:.0f} MiB{mem}")
    if reply.recent_kills:
        print(f"recent kills ({len(reply.recent_kills)}):")
        for report in reply.recent_kills:
            when = time.strftime("%H:%M:%S", time.localtime(report.time))
            print(f"[{when}] " + render_report(report).replace("\n", "\n  "))


def _summary(nodes: list[m.NodeInfo]) -> str:
    counts = {state: sum(n.state == state for n in nodes) for state in ("alive", "draining", "dead")}
    return f"{len(nodes)} node(s): " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)


def render_nodes(nodes: list[m.NodeInfo], now_unix: float, this_node: str = "") -> str:
    """The node table, one row per node, with a line under each draining or dead one saying why."""
    header = ("NODE", "STATE", "ADDRESS", "RESOURCES", "DOMAIN", "LABELS", "RUNS")
    rows = []
    for n in nodes:
        name = n.node_id + (" (head)" if n.is_head else "") + (" *" if n.node_id == this_node else "")
        rows.append((name, n.state, n.address, _resources(n.resources), n.failure_domain or "-",
                     ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())) or "-",
                     ",".join(sorted(n.used)) or "-"))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip()]
    for n, row in zip(nodes, rows):
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n.state == "dead":
            lines.append(f"      dead: silent since {time.strftime('%H:%M:%S', time.localtime(n.last_seen_unix))}")
        elif n.draining is not None:
            lines.append("      " + _draining(n.draining, now_unix))
    return "\n".join(lines)


def _draining(d: m.NodeDraining, now_unix: float) -> str:
    if d.deadline_unix_s is None:
        deadline = "no deadline"
    elif d.deadline_unix_s >= now_unix:
        deadline = f"deadline in {d.deadline_unix_s - now_unix:.0f} s"
    else:
        deadline = f"deadline passed {now_unix - d.deadline_unix_s:.0f} s ago"
    why = f"{d.reason} ({d.message})" if d.message else d.reason
    together = (f"; the drain of {d.node_id} took its failure domain: {', '.join(d.node_ids)}"
                if len(d.node_ids) > 1 else "")
    return f"draining: {why}, {deadline}{together}"


def _resources(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {format_bytes(v) if k == 'memory' else f'{v:g}'}" for k, v in sorted(resources.items()))


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="outlast", description="Run training that outlasts failures.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="start a node agent on this machine")
    s.add_argument("--block", action="store_true", help="run in the foreground until stopped")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    s.add_argument("--node-id", default=None)
    s.add_argument("--preload", default=None,
                   help="comma-separated modules the fork server imports once (default: $OUTLAST_PRELOAD, else torch "
                        "and what DDP imports, if torch is installed)")
    s.add_argument("--preemption-watchers", default="",
                   help="drain this node when these clouds announce a preemption: aws, gcp, azure (comma-separated)")
    s.add_argument("--metadata-url", action="append", default=[], metavar="CLOUD=URL",
                   help="a cloud's metadata server, when not at the standard address")
    add_arguments(s)
    add_cluster_arguments(s)  # the agent's own: --address, --cluster-key, --num-cpus, ...
    add_metrics_arguments(s)
    s.set_defaults(func=cmd_start)
    t = sub.add_parser("stop", help="stop the node agent on this machine and its workers")
    t.add_argument("--timeout", type=float, default=10.0)
    t.set_defaults(func=cmd_stop)
    st = sub.add_parser("status", help="show the node, its runs and workers")
    st.add_argument("--json", action="store_true",
                    help="print one JSON document (schema: docs/schemas/status.v1.json, docs/json.md)")
    st.set_defaults(func=cmd_status)
    add_runs_parser(sub)
    add_drain_parser(sub)
    add_run_script_parser(sub)
    add_slurm_parser(sub)
    add_dashboard_parser(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if getattr(args, "preload", "") is None:
        args.preload = _default_preload()
    try:
        sys.exit(args.func(args))
    except UnsafeStateError as e:
        print(e, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
