"""Live recovery under the public API: SIGKILLs of a rank in Trainer.fit(), live and by a restart.

    .venv/bin/python -m bench.live_recovery_fit [--kills 20] [--restart-kills 20] [--workers 2] [--shards 1]
                                                [--fsdp] [--out FILE]

2 CPU ranks (`--workers`) on the node fit() starts, a small MLP, ~20 ms steps (bench/lib/live_fit_loop.py). A
thread of this process watches the ranks' step events and SIGKILLs rank 0 and rank 1 in turn, each
at a random instant of a step, a kill every `SPACING` steps:
- live: `FailureConfig(live_recovery=True)`, `LiveTraining`; no checkpoints (`--shards S`: the optimizer's
  state split between the S ranks of each replica, `LiveTraining(shards=S)`; `--fsdp`: the MLP FSDP2's, HSDP over
  `live_mesh(S)`, its steps voted after backward, and a step in flight at a kill thrown away and run again).
- restart: the same loop with DDP and live recovery off, a checkpoint every 10 steps: outlast's
  restart of the whole group from the newest checkpoint.
For each kill: the steps lost (steps thrown away on the survivors, from their own events; for a
restart, the steps trained again after the restore and the one in flight), the seconds from the kill
to the first step that a process forked since applied, and whether the survivors kept their pids.
Then the cost when nothing fails: the median step time of the same steps with the mode on and off (with
`--fsdp`, off is the same FSDP2 model over a mesh of the run's default group),
and the warm floor (bench/lib/warm_floor.py) in the same run. Each part records the 1-minute load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench.lib.events import read_events
from bench.lib.harness import publish, stamp
from bench.lib.live_fit_loop import loop
from bench.lib.venvs import ROOT, module

STEP_S = 0.02
SPACING = 30  # steps between kills: the recovery and a few steps after it


WORKERS, SHARDS, FSDP = 2, 1, False  # set by --workers, --shards, --fsdp


def _fit(events: str, storage: str, name: str, live: bool, steps: int, ckpt_every: int, max_failures: int) -> dict:
    from outlast.train import FailureConfig, RunConfig, ScalingConfig
    from outlast.train.torch import TorchTrainer

    result = TorchTrainer(
        loop, train_loop_config={"events": events, "steps": steps, "live": live, "pad_s": STEP_S * 0.75,
                                 "ckpt_every": ckpt_every, "shards": SHARDS if live or FSDP else 1,
                                 "fsdp": FSDP and (live or not ckpt_every)},
        scaling_config=ScalingConfig(num_workers=WORKERS),
        run_config=RunConfig(name=name, storage_path=storage,
                             failure_config=FailureConfig(max_failures=max_failures, live_recovery=live)),
    ).fit()
    return {"error": None if result.error is None else str(result.error)}


class Killer(threading.Thread):
    """SIGKILLs rank 0 and rank 1 in turn, the i-th kill once the ranks applied step SPACING * (i + 1), a
    random fraction of a step after the victim's last step event; waits, after each, for a process forked
    since to apply a step. Only this run's ranks are signalled: their pids come from their own events."""

    def __init__(self, events: str, kills: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.events, self.kills, self.rng = events, kills, random.Random(seed)
        self.done: list[dict] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            for i in range(self.kills):
                # At a random step between two checkpoints (every 10 steps), at a random instant of it.
                self.done.append(self._one(i % 2, SPACING * (i + 1) + self.rng.randrange(10)))
        except Exception as e:  # noqa: BLE001 - reported in the result
            self.error = f"{type(e).__name__}: {e}"

    def _wait(self, pred, timeout_s: float = 300.0):
        end = time.time() + timeout_s
        while time.time() < end:
            got = pred(read_events(self.events))
            if got:
                return got
            time.sleep(0.002)
        raise TimeoutError("the ranks stopped making steps")

    def _one(self, victim: int, at: int) -> dict:
        last = self._wait(lambda evs: next((e for e in reversed(evs) if e["ev"] == "step" and e["rank"] == victim
                                            and e["step"] >= at), None))
        time.sleep(self.rng.uniform(0, STEP_S))
        before = read_events(self.events)
        pids = {e["rank"]: e["pid"] for e in before}  # each rank's newest process
        t_kill = time.time()
        os.kill(pids[victim], signal.SIGKILL)
        seen = {e["pid"] for e in before}
        first = self._wait(lambda evs: next((e for e in evs if e["ev"] == "step" and e["pid"] not in seen
                                             and e["t"] > t_kill), None))
        survivor = 1 - victim
        # A few steps after it, to see which process the survivor's rank runs in.
        self._wait(lambda evs: any(e["ev"] == "step" and e["rank"] == survivor and e["t"] > first["t"]
                                   and e["step"] >= first["step"] + 3 for e in evs))
        after = [e for e in read_events(self.events) if e["t"] > t_kill]
        # The victim's own newest step: the survivor's event of it may not be written yet.
        before_done = max(e["step"] for e in before if e["ev"] == "step" and e["pid"] == pids[victim])
        thrown = sorted({e["step"] for e in after if e["ev"] == "thrown" and e["pid"] == pids[survivor]})
        if first["attempt"] == last["attempt"]:  # live: the steps the survivor threw away, as it says
            lost = len(thrown)
        else:  # a restart: from the first step applied after it to the one in flight at the kill
            lost = before_done + 1 - first["step"] + 1
        survivor_steps = [e for e in after if e["rank"] == survivor and e["t"] > first["t"]]
        return {"victim": victim, "kill_after_step": last["step"], "kill_to_training_s": round(first["t"] - t_kill, 4),
                "steps_lost": lost, "thrown": thrown, "first_step_after": first["step"],
                "survivor_pid_kept": bool(survivor_steps) and all(e["pid"] == pids[survivor] for e in survivor_steps),
                "load1": round(os.getloadavg()[0], 2)}


def killed_run(tmp: str, name: str, live: bool, kills: int, seed: int) -> dict:
    events = os.path.join(tmp, f"{name}.jsonl")
    killer = Killer(events, kills, seed)
    killer.start()
    started = time.time()
    fit = _fit(events, os.path.join(tmp, "storage"), name, live, SPACING * (kills + 1) + 10,
               0 if live else 10, kills + 1)
    killer.join(timeout=60)
    with open(os.path.join(tmp, "storage", name, "run_state.json")) as f:
        history = json.load(f)
    return {"controller_live_recoveries": [{k: r.get(k) for k in ("ranks", "path", "steps_lost", "seconds", "reason")}
                                           for r in history.get("live_recoveries", [])],
            "attempts": len(history["attempts"]), "wall_s": round(time.time() - started, 1), "fit": fit, "killer_error": killer.error,
            "kills": killer.done, "kills_requested": kills}


def step_cost(tmp: str, live: bool, steps: int, round_: int = 0) -> dict:
    name = f"quiet-live-{round_}" if live else f"quiet-ddp-{round_}"
    events = os.path.join(tmp, f"{name}.jsonl")
    load = os.getloadavg()[0]
    fit = _fit(events, os.path.join(tmp, "storage"), name, live, steps, 0, 0)
    t = [e["t"] for e in read_events(events) if e["ev"] == "step" and e["rank"] == 0]
    gaps = [b - a for a, b in zip(t[10:], t[11:])]  # the first steps warm up
    return {"fit": fit, "steps": len(gaps), "step_s": summary(gaps, 5), "load1": round(load, 2)}


def warm_floor(tmp: str, repeat: int, name: str) -> dict:
    events = os.path.join(tmp, f"floor-{name}.jsonl")
    load = os.getloadavg()[0]
    subprocess.run(module(sys.executable, "bench.lib.warm_floor", "--events", events, "--repeat", str(repeat)),
                   capture_output=True, timeout=300, cwd=ROOT)
    got = [e["fork_to_step_s"] for e in read_events(events) if e.get("ev") == "warm_floor"]
    return {"fork_to_first_step_s": summary(got), "load1": round(load, 2)}


def summary(xs: list[float], digits: int = 3) -> dict | None:
    return {"median": round(statistics.median(xs), digits), "min": round(min(xs), digits),
            "max": round(max(xs), digits), "n": len(xs)} if xs else None


def totals(run: dict) -> dict:
    kills = run["kills"]
    return {"kill_to_training_s": summary([k["kill_to_training_s"] for k in kills]),
            "steps_lost": summary([k["steps_lost"] for k in kills]),
            "steps_lost_counts": {str(n): sum(k["steps_lost"] == n for k in kills)
                                  for n in sorted({k["steps_lost"] for k in kills})},
            "survivor_pids_kept": sum(k["survivor_pid_kept"] for k in kills), "kills": len(kills)}


def time_lost(t: dict, step_s: dict) -> float:
    return t["kill_to_training_s"]["median"] + t["steps_lost"]["median"] * step_s["median"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--restart-kills", type=int, default=20)
    p.add_argument("--quiet-steps", type=int, default=300)
    p.add_argument("--quiet-rounds", type=int, default=1, help="the cost when nothing fails: on and off in turn, "
                   "this many times each, the order alternating (paired ratios)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    global WORKERS, SHARDS, FSDP
    WORKERS, SHARDS, FSDP = a.workers, a.shards, a.fsdp
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="outlast-live-fit-") as tmp:
        os.environ["OUTLAST_HOME"] = os.path.join(tmp, "home")
        os.environ.pop("OUTLAST_ADDRESS", None)
        floor_before = warm_floor(tmp, 3, "before")
        live = killed_run(tmp, "live", True, a.kills, a.seed)
        restart = killed_run(tmp, "restart", False, a.restart_kills, a.seed)
        rounds = []
        for i in range(a.quiet_rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            got = {live_: step_cost(tmp, live_, a.quiet_steps, i) for live_ in order}
            rounds.append({"on": got[True], "off": got[False]})
        quiet = {**rounds[0], "rounds": rounds,
                 "paired_on_to_off": [round(r["on"]["step_s"]["median"] / r["off"]["step_s"]["median"], 3)
                                      for r in rounds if r["on"]["step_s"] and r["off"]["step_s"]]}
        if a.quiet_rounds > 1:  # the medians over every round's steps
            for side in ("on", "off"):
                quiet[side] = {"step_s": summary([m for r in rounds for m in [r[side]["step_s"]["median"]]], 5),
                               "load1": [r[side]["load1"] for r in rounds]}
        floor_after = warm_floor(tmp, 3, "after")
    lt, rt = totals(live), totals(restart)
    floor_med = statistics.median([f["fork_to_first_step_s"]["median"] for f in (floor_before, floor_after)
                                   if f["fork_to_first_step_s"]])
    med = lambda t, k: t[k]["median"] if t[k] else None  # noqa: E731
    on, off = quiet["on"]["step_s"], quiet["off"]["step_s"]
    doc = {"benchmark": "live_recovery_fit", "date": stamp(), "cpus": os.cpu_count(), "seed": a.seed,
           "workers": a.workers, "shards": a.shards, "fsdp": a.fsdp,
           "wall_s": round(time.time() - started, 1), "step_s_target": STEP_S, "kill_spacing_steps": SPACING,
           "live": {**lt, "runs": live}, "restart": {**rt, "checkpoint_every": 10, "runs": restart},
           "warm_floor": {"before": floor_before, "after": floor_after, "median_s": floor_med},
           "no_failure_step_cost": quiet,
           "ratios": {
               "restart_to_live_kill_to_training": round(med(rt, "kill_to_training_s") / med(lt, "kill_to_training_s"), 2)
               if lt["kill_to_training_s"] and rt["kill_to_training_s"] else None,
               "live_kill_to_training_to_warm_floor": round(med(lt, "kill_to_training_s") / floor_med, 2)
               if lt["kill_to_training_s"] else None,
               "restart_kill_to_training_to_warm_floor": round(med(rt, "kill_to_training_s") / floor_med, 2)
               if rt["kill_to_training_s"] else None,
               "restart_to_live_steps_lost": round(med(rt, "steps_lost") / max(med(lt, "steps_lost"), 1), 2)
               if lt["steps_lost"] and rt["steps_lost"] else None,
               # The training a kill costs: the time to train again, and the steps trained again at the step time.
               "restart_to_live_time_lost": round(time_lost(rt, off) / time_lost(lt, on), 2)
               if lt["kill_to_training_s"] and rt["kill_to_training_s"] and on and off else None,
               "step_time_on_to_off": round(on["median"] / off["median"], 3) if on and off else None},
           "note": "kill_to_training_s: from the SIGKILL to the first step applied by a process forked since (the "
                   "replacement, or the restarted group); steps_lost: live, the steps the survivor threw away (its "
                   "'thrown' events); "
                   "restart, the steps since the restored checkpoint and the one in flight (the victim's last step "
                   "event + 1 - the first step applied after + 1); restart_to_live_time_lost: kill_to_training_s "
                   "+ steps_lost x the step time, each median. controller_live_recoveries: the run's history "
                   "(run_state.json). load1: the 1-minute "
                   "load average of a 2-core machine shared with other work."}
    publish(doc, a.out)
    ok = not live["killer_error"] and not restart["killer_error"] and live["fit"]["error"] is None \
        and restart["fit"]["error"] is None
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
