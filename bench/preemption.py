"""Preemption benchmark: outlast vs Ray Train V2, the same scenario on each.

    python3 -m bench.preemption [--only ray|outlast] [--deadline-s 20]

A head that takes no workers and two 2-CPU worker nodes on loopback (Ray:
`ray.cluster_utils.Cluster`; outlast: `LocalCluster`); 2 workers on one node
(gloo), a loop of ~20 ms steps that all-reduces one number, asks the
preemption API every step, reports every step, checkpoints every 10 steps
and once more, just in time, on the first notice. At step 30 the workers'
node is drained with each framework's CLI (reason preemption, 20 s deadline),
and killed at the deadline. Then the same with no spare node.

Figures (bench/lib/preemption_scenario.py, bench/lib/ray_preemption_scenario.py):
drain -> the preemption API non-None on every rank; its cost per call while
nothing is pending; drain -> first step on the spare node; steps lost; and
what the run says and does without a spare node. Ratios are ray / outlast
(> 1: outlast better). One JSON document on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.lib import venvs
from bench.lib.harness import run_json
from bench.lib.venvs import OUTLAST_PY, RAY_PY


def ratio(ray: float | None, ours: float | None) -> float | None:
    if ray is None or ours is None or ours <= 0:
        return None
    return ray / ours


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["ray", "outlast"])
    p.add_argument("--deadline-s", type=int, default=20)
    args = p.parse_args()
    ours = ray = {}
    if args.only != "ray":
        ours = run_json(venvs.module(OUTLAST_PY, "bench.lib.preemption_scenario", "--deadline-s",
                                     str(args.deadline_s)), timeout=600)
    if args.only != "outlast":
        venvs.ensure_ray_venv()
        ray = run_json(venvs.module(RAY_PY, "bench.lib.ray_preemption_scenario", "--deadline-s",
                                    str(args.deadline_s)), timeout=600)
    figures = {}
    for key in ("drain_to_preemption_info_all_ranks_s", "get_preemption_info_idle_call_us",
                "drain_to_first_step_on_spare_s", "steps_lost"):
        o, r = ours.get(key), ray.get(key)
        figures[key] = {"outlast": o, "ray": r, "ratio": ratio(r, o) if key != "steps_lost" else None}
    doc = {
        "figures": figures,
        "without_a_spare_node": {"outlast": ours.get("no_spare"), "ray": ray.get("no_spare")},
        "outlast": ours,
        "ray": ray,
    }
    # A scenario that failed, or came back without its figures, fails the benchmark.
    ran = [name for name in ("outlast", "ray") if args.only in (None, name)]
    errors = [f"{name}: {got.get('error', 'no figures')}" for name, got in (("outlast", ours), ("ray", ray))
              if name in ran and (got.get("error") or got.get("drain_to_first_step_on_spare_s") is None)]
    doc["errors"] = errors
    print(json.dumps(doc, indent=1, default=str))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
