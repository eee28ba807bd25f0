"""What the chaos harness does and what it must find, without I/O: the fault schedule (a pure
function of the seed) and the verdicts on a finished run (a pure function of what it recorded)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

KINDS = ("node_lost", "partition_short", "partition_long", "drain", "store_outage", "store_slow",
         "driver_kill", "rank_spawn")
# What an attempt that a fault ends records: (the failure's kind or the outcome, the budget).
ENDS = {"node_lost": ("NodeLost", "worker"), "partition_long": ("NodeLost", "worker"),
        "drain": ("Preemption", "preemption"), "driver_kill": ("driver_lost", "driver")}


@dataclass(frozen=True)
class Timeouts:
    node_s: float = 2.0
    driver_s: float = 2.0


@dataclass
class Fault:
    index: int
    kind: str
    gap_s: float  # after the run is seen training again
    duration_s: float  # the cut, the outage, the slowness, the drain's deadline, the node's absence
    on_holder: bool  # a node fault aims at a node that holds a rank (else one that holds none)
    pick: int  # which of those nodes (modulo how many there are)
    rank: int  # for rank_spawn
    # Filled in by the harness as it injects:
    node: str | None = None
    attempt: int | None = None
    holders: list[str] = field(default_factory=list)
    t_start: float | None = None
    t_end: float | None = None
    note: str = ""

    @property
    def ends_attempt(self) -> bool:
        if self.kind == "driver_kill":
            return True
        return self.kind in ENDS and self.node is not None and self.node in self.holders


def schedule(seed: int, n: int, t: Timeouts, workers: int) -> list[Fault]:
    """`n` faults, every kind as evenly as `n` allows, in an order and with parameters drawn from `seed`."""
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(n)]
    rng.shuffle(kinds)
    faults = []
    for i, kind in enumerate(kinds):
        duration = {
            "node_lost": rng.uniform(0.5, 2.0),
            # The silence a cut leaves is longer than the cut: TCP's retransmissions back off, doubling, and
            # heartbeats go every 0.5 s. A cut of half the 2 s timeouts once outlasted them (seed 2, fault 83).
            "partition_short": rng.uniform(0.1, 0.25) * t.node_s,
            "partition_long": t.node_s + t.driver_s + rng.uniform(1.0, 3.0),
            "drain": rng.uniform(2.0, 4.0),
            "store_outage": rng.uniform(2.0, 5.0),
            "store_slow": rng.uniform(3.0, 6.0),
            "driver_kill": rng.uniform(0.0, 1.0),
            "rank_spawn": 0.0,
        }[kind]
        faults.append(Fault(i, kind, gap_s=rng.uniform(0.5, 2.5), duration_s=round(duration, 3),
                            on_holder=rng.random() < 0.75, pick=rng.randrange(12), rank=rng.randrange(workers)))
    return faults


def pick_node(fault: Fault, members: list[str], holders: list[str]) -> str | None:
    pool = sorted(m for m in members if (m in holders) == fault.on_holder) or sorted(members)
    return pool[fault.pick % len(pool)] if pool else None


def verdicts(faults: list[Fault], state: dict, events: list[dict], clean_digest: str | None,
             seen_checkpoints: set[str], kept_manifests: set[str], alive_pids: list[int],
             leftover: dict, worker_leaves: list[str] = (), cgroups_left: list[str] = ()) -> dict[str, str | None]:
    """Each promise -> None when it held, else what broke it."""
    out: dict[str, str | None] = {}
    digests = [e["digest"] for e in events if e["event"] == "weights"]
    out["weights_bit_identical"] = (None if digests and digests[-1] == clean_digest and len(set(digests)) == 1
                                    else f"digests {digests} against the clean run's {clean_digest}")
    committed = {c["checkpoint_dir"] for c in state.get("checkpoints", [])}
    lost = sorted((seen_checkpoints - committed) | (committed - kept_manifests))
    out["no_committed_checkpoint_lost"] = f"lost or without a manifest: {lost}" if lost else None

    attempts = state.get("attempts", [])
    ending = [f for f in faults if f.ends_attempt]
    expected_budget: dict[str, int] = {}
    for f in ending:
        expected_budget[ENDS[f.kind][1]] = expected_budget.get(ENDS[f.kind][1], 0) + 1
    got = {k: v for k, v in state.get("failure_counts", {}).items() if v}
    out["failures_charged_to_their_budget"] = (None if got == expected_budget
                                               else f"failure_counts {got}, the faults call for {expected_budget}")
    problems = []
    if len(attempts) != len(ending) + 1:
        problems.append(f"{len(attempts)} attempts for {len(ending)} faults that end one")
    for f, a in zip(ending, attempts):
        want = ENDS[f.kind][0]
        kinds = {x.get("kind") for x in a.get("failures", [])} | {a.get("outcome")}
        if want not in kinds or (f.kind != "driver_kill" and not any(x.get("node_id") == f.node
                                                                      for x in a.get("failures", []))):
            problems.append(f"fault {f.index} ({f.kind} on {f.node}) ended attempt {a['attempt']} as "
                            f"{sorted(map(str, kinds))}")
    if attempts and attempts[-1].get("outcome") != "finished":
        problems.append(f"the last attempt ended {attempts[-1].get('outcome')}")
    out["history_accounts_for_each_fault"] = "; ".join(problems) or None

    steps_lost = drain_steps_lost(faults, events)
    out["no_step_lost_to_a_drain"] = f"steps redone after drains: {steps_lost}" if any(steps_lost.values()) else None
    out["no_orphan_process"] = (None if not alive_pids and not leftover
                                else f"alive: {alive_pids}, left in the namespaces: {leftover}")
    out["no_cgroup_left"] = (None if not worker_leaves and not cgroups_left else
                             f"worker leaves once the run ended: {list(worker_leaves)}; "
                             f"cgroups once the agents stopped: {list(cgroups_left)}")
    return out


def drain_steps_lost(faults: list[Fault], events: list[dict]) -> dict[int, int]:
    """For each drain that ended an attempt: steps reported in it after the checkpoint the next one restored."""
    lost = {}
    for f in faults:
        if f.kind != "drain" or not f.ends_attempt:
            continue
        done = [e["step"] for e in events if e["event"] == "step" and e["attempt"] == f.attempt]
        restored = [e["restored_step"] for e in events if e["event"] == "start" and e["attempt"] == f.attempt + 1]
        if done and restored:
            lost[f.index] = max(done) - (restored[0] if restored[0] is not None else -1)
    return lost
