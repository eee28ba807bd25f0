"""`python -m outlast.agent`: run a node agent in the foreground."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import uuid

from outlast.agent.agent import Agent
from outlast.agent.discovery import NodeFile, remove_node_file, write_node_file
from outlast.agent.procutil import die_with_parent
from outlast.isolation.config import add_arguments, config_from_args
from outlast.isolation.errors import IsolationError


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m outlast.agent")
    p.add_argument("--node-id", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--preload", default="", help="comma-separated modules the fork server imports")
    p.add_argument("--ready-fd", type=int, default=None, help="write the address to this fd once listening")
    p.add_argument("--embedded", action="store_true", help="die with the parent process (a driver)")
    p.add_argument("--node-file", action="store_true", help="publish the address for drivers and the CLI")
    add_arguments(p)
    p.add_argument("--preemption-watchers", default="",
                   help="comma-separated clouds whose preemption notices drain this node: aws, gcp, azure")
    p.add_argument("--metadata-url", action="append", default=[], metavar="CLOUD=URL",
                   help="a cloud's metadata server, when not the standard address")
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s outlast-agent %(levelname)s %(message)s")
    if args.embedded:
        die_with_parent()
    node_id = args.node_id or uuid.uuid4().hex[:8]
    try:
        isolation = config_from_args(args)
        agent = Agent(node_id, args.host, args.port, [s for s in args.preload.split(",") if s],
                      isolation=isolation)
    except IsolationError as e:
        logging.error("%s", e)
        sys.exit(3)
    # A driver stops its embedded node at once; a standalone node drains first, so that its
    # runs can save a checkpoint (OUTLAST_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, default 30 s).
    signal.signal(signal.SIGTERM, agent.request_stop if args.embedded else agent.request_graceful_stop)
    signal.signal(signal.SIGINT, agent.request_stop)
    if args.preemption_watchers:
        urls = dict(item.split("=", 1) for item in args.metadata_url if "=" in item)
        agent.watch_cloud_notices([k for k in args.preemption_watchers.split(",") if k], urls)
    if args.node_file:
        write_node_file(NodeFile(address=agent.address, pid=os.getpid(), node_id=node_id))
    if args.ready_fd is not None:
        os.write(args.ready_fd, (agent.address + "\n").encode())
        os.close(args.ready_fd)
    try:
        agent.serve()
    finally:
        if args.node_file:
            remove_node_file(os.getpid())
    sys.exit(0)


if __name__ == "__main__":
    main()
