"""`outlast start | stop | status`: a persistent node agent on this machine."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time

import zmq

from outlast.agent.discovery import (
    AgentUnavailable, find_running_agent, node_file_path, read_node_file, request, start_agent_process, state_dir,
)
from outlast.cli.drain import add_parser as add_drain_parser
from outlast.cli.runs import add_parser as add_runs_parser
from outlast.isolation.config import add_arguments, config_from_args
from outlast.isolation.errors import IsolationError
from outlast.isolation.policy import render_report
from outlast.isolation.units import format_bytes
from outlast.protocol import messages as m
from outlast.agent.procutil import pid_alive


def _default_preload() -> str:
    # With torch installed, a node is most useful with it (and what DDP pulls in) already imported.
    if importlib.util.find_spec("torch") is not None:
        from outlast.train.torch.backend import TorchBackend

        return ",".join(TorchBackend.preload)
    return ""


def cmd_start(args: argparse.Namespace) -> int:
    ctx = zmq.Context()
    try:
        running = find_running_agent(ctx)
    finally:
        ctx.term()
    if running is not None:
        info = read_node_file()
        print(f"an outlast node is already running at {running} (pid {info.pid if info else '?'}); "
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
    agent_args += isolation.to_args()
    if args.preemption_watchers:
        unknown = sorted(set(k for k in args.preemption_watchers.split(",") if k) - {"aws", "gcp", "azure"})
        if unknown:
            print(f"--preemption-watchers: unknown cloud {', '.join(unknown)}; choose among aws, gcp, azure",
                  file=sys.stderr)
            return 2
        agent_args += ["--preemption-watchers", args.preemption_watchers]
    for url in args.metadata_url:
        agent_args += ["--metadata-url", url]
    if args.block:
        from outlast.agent.__main__ import main as agent_main

        agent_main(agent_args)
        return 0
    log_path = state_dir() / "agent.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc, address = start_agent_process([], embedded=False, extra_args=agent_args, log_path=log_path)
    except AgentUnavailable as e:
        print(f"could not start the node: {e}", file=sys.stderr)
        return 1
    # Return once the fork server has its modules imported: a fit() right after this must not
    # pay for them.
    ready = _wait_for_fork_server(address, timeout_s=180.0)
    print(f"outlast node started at {address} (pid {proc.pid}); log: {log_path}")
    if not ready:
        print("its fork server is still importing its modules; `outlast status` shows when it is ready")
    print("Trainer.fit() on this machine now uses it; `outlast stop` stops it.")
    return 0


def _wait_for_fork_server(address: str, timeout_s: float) -> bool:
    ctx = zmq.Context()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                reply = request(ctx, address, m.StatusRequest(), timeout_s=5.0)
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
    ctx = zmq.Context()
    try:
        request(ctx, info.address, m.Shutdown(), timeout_s=3.0)
    except AgentUnavailable:
        _signal(info.pid, signal.SIGTERM)
    finally:
        ctx.term()
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline and pid_alive(info.pid):
        time.sleep(0.05)
    if pid_alive(info.pid):
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
            print("no outlast node is running on this machine (start one with `outlast start`)")
            return 1
        reply = request(ctx, address, m.StatusRequest(), timeout_s=3.0)
    except AgentUnavailable as e:
        print(str(e), file=sys.stderr)
        return 1
    finally:
        ctx.term()
    assert isinstance(reply, m.StatusReply)
    up = time.time() - reply.started_at
    print(f"node {reply.node_id}  pid {reply.pid}  {reply.address}  up {up:.0f} s")
    print(f"fork server: {'ready' if reply.zygote_ready else 'starting'}, preloaded: "
          f"{', '.join(reply.preload) or 'nothing'}")
    print(f"runs: {len(reply.runs)}  workers: {len(reply.workers)}")
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
    return 0


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
                   help="comma-separated modules the fork server imports once (default: torch, if installed)")
    s.add_argument("--preemption-watchers", default="",
                   help="drain this node when these clouds announce a preemption: aws, gcp, azure (comma-separated)")
    s.add_argument("--metadata-url", action="append", default=[], metavar="CLOUD=URL",
                   help="a cloud's metadata server, when not at the standard address")
    add_arguments(s)
    s.set_defaults(func=cmd_start)
    t = sub.add_parser("stop", help="stop the node agent on this machine and its workers")
    t.add_argument("--timeout", type=float, default=10.0)
    t.set_defaults(func=cmd_stop)
    st = sub.add_parser("status", help="show the node, its runs and workers")
    st.set_defaults(func=cmd_status)
    add_runs_parser(sub)
    add_drain_parser(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if getattr(args, "preload", "") is None:
        args.preload = _default_preload()
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
