"""`python -m outlast.sim fleet`: a fleet's run simulated with each mechanism on and off, its goodput split part by
part, the controller's own cost at that size, and the invariants checked. Prints a table, or JSON with --json;
exits 1 on a violation."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, fields
from typing import Any

from outlast.sim.fleet import FleetConfig, Mechanisms, goodput_parts, seeded, simulate
from outlast.sim.fleet_cost import measure
from outlast.sim.fleet_invariants import violations
from outlast.sim.interruptions import by_mttf, llama3
from outlast.sim.run import quiet
from outlast.storage.goodput import LABELS

FLEET_VERSION = 1

# All on, each off alone, all off.
VARIANTS = [Mechanisms(), *(Mechanisms(**{f.name: False}) for f in fields(Mechanisms)),
            Mechanisms(**{f.name: False for f in fields(Mechanisms)})]
LIVE_RECOVERY = ("a rank's death asks the attempt's controller.live.LiveRun: replaced, the attempt goes on after "
                 "live_recover_s and the step in flight's time (the replacement's part of it); a lost node's ranks are "
                 "replaced together on a spare free when the loss is seen, or, with none free, an elastic run shrinks "
                 "live (the step in flight thrown away) and grows back live once a node is free; a hang or a drain is "
                 "no death and restarts as before")
PARAMS = {"step_s": "step-s", "checkpoint_gb_per_rank": "checkpoint-gb", "storage_gb_s": "storage-gb-s",
          "network_gb_s": "network-gb-s", "host_copy_gb_s": "host-copy-gb-s",
          "checkpoint_every_s": "checkpoint-every-s", "memory_every_s": "memory-every-s", "startup_s": "startup-s",
          "restart_s": "restart-s", "live_recover_s": "live-recover-s", "new_node_s": "new-node-s", "notice_s": "notice-s", "replace_s": "replace-s", "repair_s": "repair-s",
          "spares": "spares"}
MAY_BE_NONE = ("spares", "new_node_s")  # zero is a setting: no spares; a replacing node as quick as any restart


def run(config: FleetConfig, seed: int, mix: str, mttf_hours: float | None, drains_per_day: float,
        cost: bool = True) -> dict[str, Any]:
    began, cpu0 = time.perf_counter(), time.process_time()
    rng = seeded(seed)
    if mttf_hours is None:
        events = llama3(config.nodes, config.days, rng)
    else:
        events = by_mttf(config.nodes, config.days, mttf_hours, drains_per_day, rng)
    causes: dict[str, int] = {}
    for e in events:
        causes[e.cause] = causes.get(e.cause, 0) + 1
    out: dict[str, Any] = {"version": FLEET_VERSION, "seed": seed, "mix": mix if mttf_hours is None else None,
                 "mttf_hours": mttf_hours, "config": {k: v for k, v in asdict(config).items() if k != "timeouts"},
                 "interruptions": {"total": len(events), "by_cause": causes}, "variants": [], "violations": []}
    for mech in VARIANTS:
        v0 = time.process_time()
        r = simulate(config, mech, events)
        bad = violations(r, config.days)
        out["violations"] += [f"{mech.label()}: {b}" for b in bad]
        g = r.goodput
        out["variants"].append({
            "mechanisms": mech.label(), **{k: v for k, v in vars(mech).items()},
            "goodput": round(g.fraction, 5), "parts_s": goodput_parts(g), "held_s": round(g.held_s, 1),
            "steps": g.steps, "replayed_steps": g.replayed_steps, "attempts": len(r.state.attempts), "resizes": len(r.state.resizes),
            "live_resizes": sum(", live:" in x.reason for x in r.state.resizes),
            "budgets": r.budgets, "struck": r.struck, "restores": r.restores,
            "live_recoveries": r.live,
            "node_hours_smaller": round(r.node_seconds_short / 3600, 1),
            "decisions_cpu_s": round(r.decisions_s, 4), "sim_cpu_s": round(time.process_time() - v0, 2)})
    out["live_recovery"] = LIVE_RECOVERY
    base = out["variants"][0]
    out["steps_vs_all_on"] = {v["mechanisms"]: round(v["steps"] / base["steps"], 5) for v in out["variants"]}
    out["simulation"] = {"cpu_s": round(time.process_time() - cpu0, 2), "wall_s": round(time.perf_counter() - began, 2),
                         "variants": len(VARIANTS)}
    if cost:
        c = measure(config.nodes, config.ranks_per_node)
        events_per_run = len(events)
        out["controller"] = {**{k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(c).items()},
                             "what": "the real ControllerCore at this size, stepped in-process: CPU per event "
                                     "(every rank's hello, a report round with a checkpoint, a drain's notice, "
                                     "a failure to the next attempt's placing) and tracemalloc's peak",
                             "restart_cpu_s_over_the_run": round(c.restart_decision_cpu_s * events_per_run, 1)}
    out["elapsed_s"] = round(time.perf_counter() - began, 2)
    return out


def describe(out: dict[str, Any]) -> list[str]:
    c = out["config"]
    lines = [f"fleet: {c['nodes']} nodes x {c['ranks_per_node']} ranks, {c['days']:g} days, "
             f"{out['interruptions']['total']} interruptions (seed {out['seed']})"]
    for v in out["variants"]:
        lost = sorted(((s, p) for p, s in v["parts_s"].items() if p != "productive" and s > 0), reverse=True)
        where = ", ".join(f"{LABELS[p]} {100 * s / v['held_s']:.2f}%" for s, p in lost[:4])
        lines.append(f"  {v['mechanisms']:28} goodput {100 * v['goodput']:6.2f}%   {where}")
    lines.append(f"  live recovery: {out['live_recovery']}")
    if "controller" in out:
        k = out["controller"]
        lines.append(f"controller at {k['ranks']} ranks: {k['cpu_us_per_message']:.0f} us CPU a message, "
                     f"{k['restart_decision_cpu_s']:.2f} s CPU to decide a restart, {k['drain_notice_cpu_s']:.2f} s "
                     f"a drain's notice, peak {k['peak_mib']:.1f} MiB")
    lines.append(f"simulated in {out['simulation']['cpu_s']:.1f} s CPU ({out['simulation']['variants']} variants); "
                 f"{len(out['violations'])} violations")
    lines += [f"  VIOLATION {v}" for v in out["violations"]]
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m outlast.sim fleet", description=__doc__)
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--days", type=float, default=54.0)
    p.add_argument("--mix", choices=["llama3"], default="llama3",
                   help="the interruptions: Llama 3's 54 days, scaled to the nodes and days")
    p.add_argument("--mttf-hours", type=float, help="instead of the mix: each node fails at this mean time")
    p.add_argument("--drains-per-day", type=float, default=47 / 54, help="with --mttf-hours: drains over the fleet")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-cost", action="store_true", help="skip measuring the controller's own cost")
    p.add_argument("--json", action="store_true")
    defaults = FleetConfig()
    for name, flag in PARAMS.items():
        p.add_argument(f"--{flag}", type=type(getattr(defaults, name)), default=getattr(defaults, name), dest=name)
    args = p.parse_args(argv)
    if args.nodes < 1 or args.ranks_per_node < 1 or args.days <= 0:
        p.error("--nodes and --ranks-per-node must be at least 1, and --days positive")
    bad = [f"--{flag}" for name, flag in PARAMS.items() if getattr(args, name) <= 0 and name not in MAY_BE_NONE]
    none_below = [f"--{PARAMS[name]}" for name in MAY_BE_NONE if getattr(args, name) < 0]
    if bad or none_below:
        p.error(f"{', '.join(bad + none_below)} must be positive (--spares and --new-node-s at least 0)")
    config = FleetConfig(nodes=args.nodes, ranks_per_node=args.ranks_per_node, days=args.days,
                         **{name: getattr(args, name) for name in PARAMS})
    quiet()
    out = run(config, args.seed, args.mix, args.mttf_hours, args.drains_per_day, cost=not args.no_cost)
    print(json.dumps(out) if args.json else "\n".join(describe(out)))
    return 1 if out["violations"] else 0
