"""`outlast dashboard [STORAGE_PATH ...]`: the cluster and every run's life in a browser, read-only."""

from __future__ import annotations

import argparse
import ipaddress
import sys

DEFAULT_PORT = 8265


def add_parser(sub) -> None:
    p = sub.add_parser("dashboard", help="serve a read-only web view of the cluster and of the runs on storage")
    p.add_argument("storage_paths", nargs="*", metavar="STORAGE_PATH",
                   help="directories or URLs (s3://bucket/prefix, ...) whose runs to show")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only); any other needs the token "
                        "printed at start")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for a store or a node before a page says it did not answer (default 10)")
    p.set_defaults(func=cmd_dashboard)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def cmd_dashboard(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from outlast.cli.dashboard.app import build_app, new_token
        from outlast.cli.dashboard.sources import Sources
    except ImportError as e:
        print(f"the dashboard needs its extra ({e}): pip install 'outlast[dashboard]'", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"--port must be between 1 and 65535, got {args.port}", file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print(f"--timeout must be a number of seconds above 0, got {args.timeout}", file=sys.stderr)
        return 2
    loopback = is_loopback(args.host)
    token = None if loopback else new_token()
    app = build_app(Sources(args.storage_paths, timeout_s=args.timeout), token, loopback)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown}:{args.port}/runs" + (f"?token={token}" if token else "")
    paths = ", ".join(args.storage_paths) or "none (give STORAGE_PATH ... to show runs)"
    print(f"outlast dashboard at {url}\n  runs from: {paths}", flush=True)
    if token:
        print("  it listens beyond this machine, so every request needs the token in that URL", flush=True)
    try:
        server.run()
    except (OSError, SystemExit) as e:
        print(f"the dashboard could not listen on {args.host}:{args.port} ({e}); choose another --port or --host",
              file=sys.stderr)
        return 1
    return 0
