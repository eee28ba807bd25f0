"""Live recovery under Trainer.fit(): steps lost per kill by phase, training efficiency, bit-identical weights.

    .venv/bin/python -m bench.live_recovery_kills [--kills 200] [--efficiency-steps 1000]
        [--identical-kills 100] [--step-s 0.02] [--parts phases,efficiency,identical,cost] [--out FILE]
    .venv/bin/python -m bench.live_recovery_kills --quick   # 24 kills, 200 steps, 12 kills: about 3 min

CPU ranks on the node fit() starts, a small MLP, ~20 ms steps (bench/lib/live_kill_loop.py). Each kill is a
SIGKILL of a rank by itself, at an instant of a step its plan names (bench/lib/live_kills.py): a phase
(forward, backward, the allreduce, the optimizer's step, report(), rank 0's checkpoint upload) and a random
fraction of that phase's usual length. The parts:
- phases: `--kills` kills at 2 ranks, one every 20 steps, the phases in turn, a checkpoint every 10 steps;
  the steps lost per kill by the phase it landed in, from the survivors' own counts and from the run's
  history (`live_recoveries`). Then the same kills with live recovery off: the whole group restarts from
  the newest checkpoint, and the steps lost are those trained again.
- efficiency: `--efficiency-steps` steps of `--step-s` at 2 ranks without a failure, then with a kill every 5
  and every 2 steps: the useful steps over wall time, against the run without failures.
- identical: at 2 and at 3 ranks, `--identical-kills` kills (one every 5 steps, rank 0 among the victims)
  and a run without failures; every rank's final weights against the run without failures, torch.equal.
  The efficiency runs' final weights are compared too.
- cost: the step time with the mode on and off, nothing failing (bench/live_recovery_fit.py's measure).
- nodes (alone, as root): `--nodes-kills` kills at 8 ranks, a CPU each, on 4 nodes of 2 CPUs in network
  namespaces (tests/integration/netns.py, as bench/kill_nodes.py); the start events name each rank's
  network namespace, so the result says how many the ranks ran in. `--out` writes the whole document: the part
  carries its date, warm floor and ratios, to be copied into a file of the other parts.
The warm floor (bench/lib/warm_floor.py) before and after. Each run records the 1-minute load average: the
machine has 2 cores, shared with other work. Ray Train 2.60 has no live mode; its restart figure is quoted
from bench/results/core_kill.json, not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from bench.lib import live_kills
from bench.lib.events import read_events
from bench.lib.harness import publish, stamp
from bench.lib.live_kill_loop import loop
from bench.lib.venvs import ROOT
from bench.live_recovery_fit import step_cost, warm_floor

STEP_S = 0.02
PHASE_EVERY, PHASE_CKPT_EVERY = 20, 10  # a kill every 20 steps; a checkpoint every 10 (off: the steps at risk)
NO_CKPT_PHASES = tuple(p for p in live_kills.PHASES if p != "checkpoint")


def log(msg: str) -> None:
    print(f"[live-kills {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fit(tmp: str, name: str, *, live: bool, ranks: int, steps: int, kills: list[live_kills.Kill],
        ckpt_every: int = 0, final: bool = False, cpus_per_rank: float = 0, step_s: float = STEP_S) -> dict:
    """One Trainer.fit() of the loop; its events, its history and (with `final`) its ranks' final weights."""
    from outlast.train import FailureConfig, RunConfig, ScalingConfig
    from outlast.train.torch import TorchTrainer

    events, marks = os.path.join(tmp, f"{name}.jsonl"), os.path.join(tmp, f"{name}-marks")
    final_dir = os.path.join(tmp, f"{name}-final") if final else None
    for d in (marks, final_dir):
        if d:
            os.makedirs(d)
    load, started = round(os.getloadavg()[0], 2), time.time()
    result = TorchTrainer(
        loop, train_loop_config={"events": events, "marks": marks, "steps": steps, "live": live,
                                 "pad_s": step_s * 0.75, "ckpt_every": ckpt_every, "final_dir": final_dir,
                                 "kills": live_kills.as_config(kills)},
        # Without a request ranks are placed by count, all on the first node; a CPU each spreads them.
        scaling_config=ScalingConfig(num_workers=ranks,
                                     resources_per_worker={"CPU": cpus_per_rank} if cpus_per_rank else None),
        run_config=RunConfig(name=name, storage_path=os.path.join(tmp, "storage"),
                             failure_config=FailureConfig(max_failures=len(kills) + 2, live_recovery=live)),
    ).fit()
    wall = round(time.time() - started, 1)
    with open(os.path.join(tmp, "storage", name, "run_state.json")) as f:
        history = json.load(f)
    evs = read_events(events)
    log(f"{name}: {wall} s, {sum(e['ev'] == 'kill' for e in evs)} kills of {len(kills)}, error {result.error}")
    return {"name": name, "events": evs, "history": history, "final_dir": final_dir,
            "run": {"fit_error": None if result.error is None else str(result.error), "fit_wall_s": wall,
                    "load1_before": load, "load1_after": round(os.getloadavg()[0], 2),
                    "attempts": len(history["attempts"]), "kills_planned": len(kills),
                    "kills_made": sum(e["ev"] == "kill" for e in evs),
                    "training": live_kills.training_span(evs)}}


def recoveries(history: dict) -> dict:
    recs = history.get("live_recoveries", [])
    return {"n": len(recs), "paths": _count(r.get("path") for r in recs),
            "steps_lost": live_kills.counts([r.get("steps_lost") for r in recs]),
            "seconds": live_kills.summary([r.get("seconds") for r in recs]),
            "restart_reasons": sorted({r.get("reason") for r in recs if r.get("path") != "live"})}


def _count(xs) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


def phases_part(tmp: str, kills: int, seed: int) -> dict:
    plan = live_kills.plan(kills, PHASE_EVERY, 2, seed, ckpt_every=PHASE_CKPT_EVERY)
    steps = plan[-1].step + PHASE_EVERY if plan else 40
    out = {"kill_every_steps": PHASE_EVERY, "checkpoint_every_steps": PHASE_CKPT_EVERY, "steps": steps}
    for mode, live in (("live", True), ("restart", False)):
        got = fit(tmp, f"phases-{mode}", live=live, ranks=2, steps=steps, kills=plan, ckpt_every=PHASE_CKPT_EVERY)
        per_kill = (live_kills.live_losses if live else live_kills.restart_losses)(got["events"])
        out[mode] = {**got["run"], "steps_lost": live_kills.counts([k["steps_lost"] for k in per_kill]),
                     "steps_lost_by_phase": live_kills.by_phase(per_kill),
                     "steps_lost_by_planned_phase": live_kills.by_phase(per_kill, "phase"),
                     "steps_lost_summary": live_kills.summary([k["steps_lost"] for k in per_kill], 2),
                     "kill_to_training_s": live_kills.summary([k["kill_to_training_s"] for k in per_kill]),
                     "history": recoveries(got["history"]), "kills": per_kill}
        if live:
            out[mode]["survivors_disagree"] = [k["index"] for k in per_kill if not k["survivors_agree"]]
            out[mode]["survivor_pids_kept"] = sum(k["survivor_pids_kept"] for k in per_kill)
    return out


def weights_equal(clean_dir: str, killed_dir: str, ranks: int) -> dict:
    """Each rank's final state dict of the killed run against rank 0's of the run without failures."""
    import torch

    ref = torch.load(os.path.join(clean_dir, "rank0.pt"))
    out = {}
    for r in range(ranks):
        path = os.path.join(killed_dir, f"rank{r}.pt")
        if not os.path.exists(path):
            out[str(r)] = "missing"
            continue
        got = torch.load(path)
        out[str(r)] = got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    return {"ranks": out, "all_equal": all(v is True for v in out.values())}


def efficiency_part(tmp: str, steps: int, seed: int, step_s: float) -> dict:
    clean = fit(tmp, "eff-clean", live=True, ranks=2, steps=steps, kills=[], final=True, step_s=step_s)
    out = {"steps": steps, "step_s_target": step_s, "clean": clean["run"]}
    for every in (5, 2):
        n = max(0, (steps - 20) // every - 1)
        got = fit(tmp, f"eff-every{every}", live=True, ranks=2, steps=steps, final=True, step_s=step_s,
                  kills=live_kills.plan(n, every, 2, seed + every, phases=NO_CKPT_PHASES))
        per_kill = live_kills.live_losses(got["events"])
        cw, kw = clean["run"]["training"]["wall_s"], got["run"]["training"]["wall_s"]
        extra = (kw - cw) / max(got["run"]["kills_made"], 1) if cw and kw else None
        out[f"every_{every}"] = {
            **got["run"], "efficiency": live_kills.efficiency(cw, kw) if cw and kw else None,
            # Each kill costs at least a step's forward and backward: the survivors keep their gradients of the
            # step that broke, and wait for the replacement's, so the most a run can reach recovering in no time.
            "bound_a_step_a_kill": live_kills.efficiency_bound(every, 1),
            "seconds_per_kill": round(extra, 4) if extra is not None else None,
            "steps_lost": live_kills.counts([k["steps_lost"] for k in per_kill]),
            "kill_to_training_s": live_kills.summary([k["kill_to_training_s"] for k in per_kill]),
            "history": recoveries(got["history"]),
            "weights_equal_clean": weights_equal(clean["final_dir"], got["final_dir"], 2)}
    return out


def identical_part(tmp: str, kills: int, seed: int) -> dict:
    out = {"kill_every_steps": 5, "kills": kills}
    for ranks in (2, 3):
        plan = live_kills.plan(kills, 5, ranks, seed + ranks, phases=NO_CKPT_PHASES)
        steps = (plan[-1].step if plan else 20) + 10
        clean = fit(tmp, f"same-clean-{ranks}", live=True, ranks=ranks, steps=steps, kills=[], final=True)
        got = fit(tmp, f"same-killed-{ranks}", live=True, ranks=ranks, steps=steps, kills=plan, final=True)
        made = [e for e in got["events"] if e["ev"] == "kill"]
        out[f"ranks_{ranks}"] = {
            "steps": steps, "clean": clean["run"], "killed": got["run"],
            "victims": _count(e["rank"] for e in made), "hit_phases": _count(e["hit_phase"] for e in made),
            "history": recoveries(got["history"]),
            "weights_equal_clean": weights_equal(clean["final_dir"], got["final_dir"], ranks)}
    return out


def nodes_part(tmp: str, kills: int, ranks: int, seed: int) -> dict:
    """`ranks` ranks on 4 nodes: this process's node and 3 members, each in a network namespace of its own with its
    own address on a bridge (tests/integration/netns.py, as bench/kill_nodes.py), every fork server warm. Needs
    root."""
    from outlast.client.preload import default_preload
    from tests.integration.netns import NetnsCluster

    cluster = NetnsCluster(num_members=3, workdir=os.path.join(tmp, "netns"), node_timeout_s=3.0,
                           extra_args=["--num-cpus", "2", "--preload", ",".join(default_preload())])
    saved = dict(os.environ)
    try:
        cluster.wait_joined()
        os.environ.update(cluster.env)
        plan = live_kills.plan(kills, PHASE_EVERY, ranks, seed, phases=NO_CKPT_PHASES)
        got = fit(tmp, f"nodes-{ranks}", live=True, ranks=ranks, steps=(plan[-1].step if plan else 20) + PHASE_EVERY,
                  kills=plan, cpus_per_rank=1)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        cluster.shutdown()
    per_kill = live_kills.live_losses(got["events"])
    netns = {e["netns"] for e in got["events"] if e["ev"] == "start"}
    return {**got["run"], "ranks": ranks, "nodes": 4, "network_namespaces_of_ranks": len(netns),
            "steps_lost": live_kills.counts([k["steps_lost"] for k in per_kill]),
            "kill_to_training_s": live_kills.summary([k["kill_to_training_s"] for k in per_kill]),
            "survivor_pids_kept": sum(k["survivor_pids_kept"] for k in per_kill),
            "history": recoveries(got["history"]), "kills": per_kill}


def cost_part(tmp: str, steps: int) -> dict:
    on, off = step_cost(tmp, True, steps), step_cost(tmp, False, steps)
    return {"on": on, "off": off, "on_to_off": round(on["step_s"]["median"] / off["step_s"]["median"], 3)
            if on["step_s"] and off["step_s"] else None,
            "note": "bench/lib/live_fit_loop.py: LiveTraining against DDP, the median of the steps after the 10th"}


def ray_restart() -> dict:
    with open(os.path.join(ROOT, "bench", "results", "core_kill.json")) as f:
        core = json.load(f)
    fig = core["figures"]["kill.cluster.kill_to_training_s"]
    return {"source": "bench/results/core_kill.json (not run here: Ray Train 2.60 has no live mode)",
            "date": core["date"], "ray_kill_to_training_s": fig["ray"], "outlast_kill_to_training_s": fig["outlast"],
            "steps_lost": core["figures"]["kill.cluster.steps_lost"]["ray"],
            "load1": core["figures"]["kill.cluster.load1"]["ray"]}


def nodes_ratios(doc: dict, floor: float | None) -> dict | None:
    got = doc["nodes"]["kill_to_training_s"]
    if not got or not floor:
        return None
    return {"kill_to_training_to_warm_floor": round(got["median"] / floor, 2),
            "ray_restart_to_kill_to_training": round(doc["ray_2_60"]["ray_kill_to_training_s"]["median"]
                                                     / got["median"], 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=200)
    p.add_argument("--efficiency-steps", type=int, default=1000)
    p.add_argument("--step-s", type=float, default=STEP_S, help="the efficiency part's step time (most of it a sleep)")
    p.add_argument("--identical-kills", type=int, default=100)
    p.add_argument("--quiet-steps", type=int, default=300)
    p.add_argument("--nodes-kills", type=int, default=10, help="kills at 8 ranks on 4 nodes (the part 'nodes')")
    p.add_argument("--parts", default="phases,efficiency,identical,cost")
    p.add_argument("--quick", action="store_true", help="24 kills, 200 steps, 12 kills, 150 quiet steps")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out")
    a = p.parse_args()
    if a.quick:
        a.kills, a.efficiency_steps, a.identical_kills, a.quiet_steps = 24, 200, 12, 150
    parts = a.parts.split(",")
    unknown = set(parts) - {"phases", "efficiency", "identical", "cost", "nodes"}
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}: choose among phases, efficiency, identical, cost, nodes")
    if "nodes" in parts and len(parts) > 1:
        p.error("run the part 'nodes' alone (--parts nodes): it needs root, and its fit() uses the cluster it starts")
    started, load_start = time.time(), [round(x, 2) for x in os.getloadavg()]
    doc: dict = {"benchmark": "live_recovery_kills", "date": stamp(), "cpus": os.cpu_count(), "seed": a.seed,
                 "step_s_target": STEP_S, "load_at_start": load_start}
    with tempfile.TemporaryDirectory(prefix="outlast-live-kills-") as tmp:
        os.environ["OUTLAST_HOME"] = os.path.join(tmp, "home")
        os.environ.pop("OUTLAST_ADDRESS", None)
        floor_before = warm_floor(tmp, 3, "before")
        if "phases" in parts:
            doc["phases"] = phases_part(tmp, a.kills, a.seed)
        if "efficiency" in parts:
            doc["efficiency"] = efficiency_part(tmp, a.efficiency_steps, a.seed, a.step_s)
        if "identical" in parts:
            doc["identical"] = identical_part(tmp, a.identical_kills, a.seed)
        if "nodes" in parts:
            doc["nodes"] = nodes_part(tmp, a.nodes_kills, 8, a.seed)
        if "cost" in parts:
            doc["no_failure_step_cost"] = cost_part(tmp, a.quiet_steps)
        floor_after = warm_floor(tmp, 3, "after")
    floors = [f["fork_to_first_step_s"]["median"] for f in (floor_before, floor_after) if f["fork_to_first_step_s"]]
    floor = round(sorted(floors)[len(floors) // 2], 3) if floors else None
    doc["warm_floor"] = {"before": floor_before, "after": floor_after, "median_s": floor}
    doc["ray_2_60"] = ray_restart()
    if "phases" in parts and floor:
        ph = doc["phases"]
        doc["ratios"] = {f"{m}_kill_to_training_to_warm_floor": round(ph[m]["kill_to_training_s"]["median"] / floor, 2)
                         for m in ("live", "restart") if ph[m]["kill_to_training_s"]}
        doc["ratios"]["ray_restart_to_live_kill_to_training"] = round(
            doc["ray_2_60"]["ray_kill_to_training_s"]["median"] / ph["live"]["kill_to_training_s"]["median"], 1) \
            if ph["live"]["kill_to_training_s"] else None
    if "nodes" in parts:
        # The part runs alone and is merged into a file of the other parts by hand: it carries its own date, floor
        # and ratios.
        doc["nodes"].update(date=doc["date"], warm_floor_median_s=floor, ratios=nodes_ratios(doc, floor))
    doc["wall_s"] = round(time.time() - started, 1)
    doc["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["note"] = ("steps_lost: live, the steps a surviving process threw away after the kill (its 'thrown' "
                   "events), the most over the survivors; restart, the steps the killed attempt applied since the "
                   "checkpoint the next attempt restored, and the one in flight. history: the run's own "
                   "live_recoveries (run_state.json). phase: the phase planned; hit_phase: the one the loop was in "
                   "at the SIGKILL. kill_to_training_s: to the first step applied by a process started since. "
                   "efficiency: the run without failures' wall time from rank 0's first applied step to its last, "
                   "over the same with kills. load1: the 1-minute load average of a 2-core machine shared with "
                   "other work.")
    publish(doc, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
