"""Elastic benchmark: outlast vs Ray Train V2 (2.60), the same scenario on each.

    python3 -m bench.elastic [--only ray|outlast] [--repeats 3] [--ray-repeats 1]

A head that takes no workers and two 1-CPU worker nodes on loopback (Ray:
`ray.cluster_utils.Cluster`; outlast: `LocalCluster`); ScalingConfig(num_workers=(1, 2)),
one CPU per worker, gloo, a loop of ~20 ms steps that all-reduces one number, asks the
preemption API every step, reports every step, checkpoints every 10 steps and once more on
the first notice (bench/lib/elastic_scenario.py, bench/lib/ray_elastic_scenario.py).

  node lost, no spare: one worker node killed -> first step at world size 1; steps lost.
  node added: a 1-CPU node joins -> first step at world size 2; steps lost.

outlast runs with elastic_resize_monitor_interval_s 0 (the grow itself) and once at its
default 60 s; Ray at its default 60 s (its resize monitor's period). outlast runs it also with
live recovery (`--live` of bench/lib/elastic_scenario.py: the group shrinks and grows in the same
processes, no checkpoint read; the shrink throws the step in flight away). Ratios are
ray / outlast (> 1: outlast faster); `ratio_live` is Ray's over live recovery's. One JSON
document on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.lib import venvs
from bench.lib.harness import run_json
from bench.lib.venvs import OUTLAST_PY, RAY_PY

FIGURES = ("lost_to_training_at_smaller_size_s", "lost_steps_lost", "added_to_training_at_larger_size_s",
           "added_steps_lost")


def median(doc: dict, key: str):
    fig = (doc.get("figures") or {}).get(key)
    return fig["median"] if isinstance(fig, dict) else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["ray", "outlast"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ray-repeats", type=int, default=1, help="each Ray repeat takes about 6 minutes")
    args = p.parse_args()
    ours = ours_60 = ours_live = ray = {}
    if args.only != "ray":
        ours = run_json(venvs.module(OUTLAST_PY, "bench.lib.elastic_scenario", "--repeats", str(args.repeats)),
                        timeout=300 * args.repeats)
        ours_live = run_json(venvs.module(OUTLAST_PY, "bench.lib.elastic_scenario", "--repeats", str(args.repeats),
                                          "--live"), timeout=300 * args.repeats)
        ours_60 = run_json(venvs.module(OUTLAST_PY, "bench.lib.elastic_scenario", "--repeats", "1",
                                        "--interval-s", "60"), timeout=400)
    if args.only != "outlast":
        venvs.ensure_ray_venv()
        ray = run_json(venvs.module(RAY_PY, "bench.lib.ray_elastic_scenario", "--repeats", str(args.ray_repeats),
                                    "--interval-s", "60"), timeout=560 * args.ray_repeats + 60)
    figures = {}
    for key in FIGURES:
        o, o60, live, r = median(ours, key), median(ours_60, key), median(ours_live, key), median(ray, key)
        timed = key.endswith("_s") and r is not None
        figures[key] = {"outlast": o, "outlast_interval_60s": o60, "outlast_live": live, "ray": r,
                        "ratio": r / o if timed and o else None, "ratio_live": r / live if timed and live else None}
    print(json.dumps({"figures": figures, "outlast": ours, "outlast_interval_60s": ours_60, "outlast_live": ours_live,
                      "ray": ray}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
