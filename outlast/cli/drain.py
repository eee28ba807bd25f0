"""`outlast drain-node`: tell a node it will go away, so its runs save a checkpoint and move."""

from __future__ import annotations

import argparse
import sys

import zmq

from outlast.agent.discovery import AgentUnavailable, find_running_agent, request
from outlast.protocol import messages as m


def add_parser(sub) -> None:
    p = sub.add_parser("drain-node", help="mark a node as going away (a preemption, maintenance)")
    p.add_argument("--node-id", required=True, help="the node's id, as `outlast status` shows it")
    p.add_argument("--reason", default="preemption", choices=["preemption", "maintenance", "idle", "other"])
    p.add_argument("--reason-message", default="", help="free text shown to the runs on the node")
    p.add_argument("--deadline-remaining-seconds", type=float, default=None,
                   help="seconds until the node goes away (default: no deadline)")
    p.set_defaults(func=cmd_drain)


def cmd_drain(args: argparse.Namespace) -> int:
    if args.deadline_remaining_seconds is not None and args.deadline_remaining_seconds < 0:
        print("--deadline-remaining-seconds must be >= 0", file=sys.stderr)
        return 2
    ctx = zmq.Context()
    try:
        address = find_running_agent(ctx)
        if address is None:
            print("no outlast node is running on this machine (start one with `outlast start`)", file=sys.stderr)
            return 1
        status = request(ctx, address, m.StatusRequest(), timeout_s=3.0)
        assert isinstance(status, m.StatusReply)
        if status.node_id != args.node_id:
            print(f"no node {args.node_id!r} here: this machine's node is {status.node_id!r}", file=sys.stderr)
            return 1
        ack = request(ctx, address, m.DrainNode(node_id=args.node_id, reason=args.reason,
                                                message=args.reason_message,
                                                deadline_remaining_s=args.deadline_remaining_seconds), timeout_s=3.0)
    except AgentUnavailable as e:
        print(str(e), file=sys.stderr)
        return 1
    finally:
        ctx.term()
    assert isinstance(ack, m.DrainAck)
    deadline = (f"in {args.deadline_remaining_seconds:.0f} s" if args.deadline_remaining_seconds is not None
                else "with no deadline")
    print(f"node {ack.node_id} is draining {deadline}; {ack.runs_notified} run(s) told to save and move")
    return 0
