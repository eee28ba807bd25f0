"""`outlast drain-node`: tell a node it will go away, so its runs save a checkpoint and move.

The head keeps the node table, so the drain goes to it: the local agent's head, the local
agent when it is the head, or whatever $OUTLAST_ADDRESS names (a head, or a member whose head
is then asked). The head drains the node's whole failure domain with it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import zmq

from outlast.client.discovery import AgentUnavailable, find_running_agent, request
from outlast.protocol import messages as m


def add_parser(sub) -> None:
    p = sub.add_parser("drain-node", help="mark a node as going away (a preemption, maintenance)")
    p.add_argument("--node-id", required=True, action="extend", nargs="+",
                   help="the node's id, as `outlast status` shows it; several ids are one drain, told to each run "
                        "as one notice naming them all")
    p.add_argument("--reason", default="preemption", choices=["preemption", "maintenance", "idle", "other"])
    p.add_argument("--reason-message", default="", help="free text shown to the runs on the node")
    p.add_argument("--deadline-remaining-seconds", type=float, default=None,
                   help="seconds until the node goes away (default: no deadline)")
    p.set_defaults(func=cmd_drain)


def cmd_drain(args: argparse.Namespace) -> int:
    deadline_s = args.deadline_remaining_seconds
    if deadline_s is not None and not 0 <= deadline_s < math.inf:
        print(f"--deadline-remaining-seconds must be a finite number of seconds >= 0, got {deadline_s}; "
              "leave it out for a drain with no deadline", file=sys.stderr)
        return 2
    first, *also = args.node_id
    named = ", ".join(args.node_id)
    ctx = zmq.Context()
    head = None
    try:
        address = find_running_agent(ctx)
        if address is None:
            print("no outlast node is running on this machine (start one with `outlast start`)", file=sys.stderr)
            return 1
        pong = request(ctx, address, m.Ping(), timeout_s=5.0)
        assert isinstance(pong, m.Pong)
        head = pong.head_address or address
        reply = request(ctx, head, m.DrainNode(node_id=first, also=also, reason=args.reason,
                                               message=args.reason_message,
                                               deadline_remaining_s=args.deadline_remaining_seconds), timeout_s=5.0)
    except AgentUnavailable as e:
        where = f"the cluster's head at {head} (it keeps the node table): " if head else ""
        print(f"could not drain {named}: {where}{e}", file=sys.stderr)
        return 1
    finally:
        ctx.term()
    if isinstance(reply, m.DrainRefused):
        whose = "the node at $OUTLAST_ADDRESS" if os.environ.get("OUTLAST_ADDRESS") else "this machine's node"
        print(f"the head refused to drain {named}: {reply.reason}; {whose} is {pong.node_id!r}",
              file=sys.stderr)
        return 1
    assert isinstance(reply, m.DrainAck)
    deadline = (f"in {args.deadline_remaining_seconds:.0f} s" if args.deadline_remaining_seconds is not None
                else "with no deadline")
    others = [i for i in reply.node_ids if i not in args.node_id]
    domain = f"; with {'it' if not also else 'them'}, failure domain peers: {', '.join(others)}" if others else ""
    print(f"node{'s' if also else ''} {named} {'are' if also else 'is'} draining {deadline}{domain}")
    print(f"drained: {', '.join(reply.node_ids or [reply.node_id])}; the runs with workers there are told to save "
          "a checkpoint and move")
    return 0
