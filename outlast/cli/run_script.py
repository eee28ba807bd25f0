"""`outlast run script.py [args]`: run a Ray Train script, unchanged, on outlast.

The script runs in this process as `__main__` (as `python script.py [args]` would run it),
with `ray` resolving to outlast (outlast/compat/ray_alias.py): `ray.train` is
`outlast.train`, `ray.init()` is accepted, and any other Ray API stops the script with
the call and its line.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a Ray Train script unchanged: ray.train is outlast.train in it",
                       description="Run a Ray Train script as `python SCRIPT ARGS` would, with `ray.train` and "
                                   "`ray.train.torch` resolving to outlast's; any other Ray API stops it with the "
                                   "call and its line. docs/ray-parity.md lists what is the same and what differs.")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from outlast.compat.ray_alias import UnsupportedRayAPI, install

    script = os.path.abspath(args.script)
    if not os.path.isfile(script):
        print(f"outlast run: {args.script} is not a file", file=sys.stderr)
        return 2
    install()
    sys.argv = [script, *args.args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except UnsupportedRayAPI as e:
        print(f"outlast run: {e}", file=sys.stderr)
        return 2
    return 0
