"""A schedule: the loop the workers run, the cluster, the settings, and the faults, all drawn from a seed."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoopSpec:
    world_size: int
    step_s: float
    steps: int
    asks: bool  # calls get_preemption_info() once per step
    jit: bool  # saves a checkpoint the first time it returns a notice (the guide's pattern)
    return_on_notice: bool  # ... and then returns from the train function
    report_every: int  # steps per report()
    checkpoint_every: int  # reports per checkpoint
    sharded: bool  # every rank writes files (else rank 0 alone)
    done_lost: bool  # rank 0's last message (WorkerDone) never arrives: the process exited before it left
    async_upload: bool  # report(upload_mode=ASYNC): the files follow on the upload thread's own socket
    children: int = 0  # processes each rank starts (a data loader's workers): none may outlive the rank
    exit_loses_messages: bool = False  # what a rank's upload socket still holds when it exits is lost
    shards: int = 1  # live recovery: LiveTraining(shards=...), the optimizer's state split between each replica's ranks
    mesh: bool = False  # live recovery: an FSDP2 model over live_mesh(shards), its reductions inside backward


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str  # kill_worker | lose_node | drain | drain_empty | driver_death | storage_fail | add_node | hang
    #          | storage_slow (each call slower than the driver timeout, for duration_s)
    #          | fork_server_death | agent_death (an embedded node's: a new node replaces it) | agent_restart (a persistent node's)
    #          | arm_in_grow (FAIL_KINDS[deadline_s] strikes duration_s after the next grow's notice)
    #          | interrupt (Ctrl+C in the driver) | lease_lost | unkillable (a rank stuck in the kernel: no signal
    #          ends it until duration_s has passed, inf: never)
    #          | newer_document (while no driver lives, a newer outlast rewrites NEWER_DOCUMENTS[target])
    #          | corrupt_copy (a bit flips in a node's RAM, in its newest copy; odd target: in every copy of it)
    #          | lose_holders (the nodes holding the newest committed checkpoint: odd target, all; even, one)
    #          | kill_at, drain_at, grow_at (live recovery: rank `target` is killed, its node drained, or a node
    #          joins, when the rank next reaches `point` of its step)
    target: int = 0  # a rank, or a node's index
    deadline_s: float | None = None  # drains
    duration_s: float = 0.0  # storage_fail; agent_death and agent_restart: until the agent is back
    same_host: bool = True  # agent_restart: the driver's machine, where it sees the agent's pid gone at once
    latency_s: float = 0.0  # storage_slow: what each storage call takes meanwhile
    point: str = ""  # kill_at: where in a live step the rank dies (`outlast/sim/live.py`'s POINTS)


@dataclass(frozen=True)
class TierSpec:
    """The nodes keep checkpoints in memory (`outlast start --checkpoint-memory`), and the run says where a
    checkpoint must be for report() to return (`CheckpointConfig(checkpoint_storage=...)`)."""

    checkpoint_storage: str  # "storage" (durable, with copies in memory beside) or "memory" (memory only)
    budget_copies: int  # each node's budget, in copies of one rank's files of one checkpoint
    domains: int  # 0: every node a failure domain of its own; k: node i in domain i % k


@dataclass(frozen=True)
class Schedule:
    seed: int
    loop: LoopSpec
    nodes: int
    cpus_per_node: int
    strategy: str
    max_failures: int
    num_to_keep: int | None
    max_delay_s: float
    storage_latency_s: float
    refuse_deletes: bool
    faults: list[Fault] = field(default_factory=list)
    min_workers: int = 0  # > 0: an elastic run, num_workers=(min_workers, loop.world_size)
    resize_interval_s: float = 0.0  # elastic_resize_monitor_interval_s
    hang_timeout_s: float = float("inf")  # finite: ranks send progress, and a "hang" fault wedges one
    tier: TierSpec | None = None  # the nodes' memory tiers (outlast/sim/tier.py); None: the nodes keep none
    live: bool = False  # FailureConfig(live_recovery=True): the ranks run live recovery's protocol (outlast/sim/live.py)

    @property
    def nominal_s(self) -> float:
        return self.loop.steps * self.loop.step_s


KINDS = ["kill_worker", "lose_node", "drain", "drain", "drain", "drain_empty", "driver_death", "storage_fail",
         "double_drain"]


# Faults of outlast's own processes, mixed with those of the user's: drawn from a stream of their own, so that
# the schedules above (and the regression seeds found with them) stay as they were.
AGENT_KINDS = ["fork_server_death", "fork_server_death", "agent_death", "agent_restart", "agent_restart",
               "kill_worker", "driver_death"]


# The edges: faults one step off the tested path, drawn (with `edges=True`) from a stream of their own again.
EDGE_KINDS = ["drain_then_fail", "drain_then_fail", "grow_then_fail", "interrupt", "lease_lost", "unkillable"]
FAIL_KINDS = ["kill_worker", "kill_worker", "lose_node", "fork_server_death"]
NEWER_DOCUMENTS = ["run state", "latest manifest", "lease"]


def draw(seed: int, elastic: bool = False, edges: bool = False, tier: bool = False) -> Schedule:
    """`elastic`: the same schedule as an elastic run (num_workers=(min, world)), with nodes that join; drawn
    from a second generator, so that the seed's other choices stay as they are. Faults of outlast's own
    processes (the fork server, the agent) come from a stream of their own. `edges`: besides,
    failures during drains and grows, Ctrl+C and lease loss at any instant, unkillable ranks, ranks with
    children, and messages lost at a rank's exit; a third of them elastic. `tier`: the nodes keep checkpoints in
    memory (`_tier`)."""
    if edges:
        return _edges(seed, draw(seed, elastic or random.Random(seed ^ 0xED6E).random() < 0.35, tier=tier))
    s = _draw(seed, elastic)
    rng = random.Random(seed * 2 + 1 + (1 << 40))
    extra = []
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        extra.append(Fault(rng.uniform(0.0, s.nominal_s * 1.2 + 0.5), rng.choice(AGENT_KINDS),
                           target=rng.randrange(max(s.loop.world_size, s.nodes)),
                           duration_s=rng.choice([rng.uniform(0.5, 5.0), rng.uniform(5.0, 60.0)]),
                           same_host=rng.random() < 0.7))
    # Storage slower than the agents' patience with a silent driver: from a stream of its own, as above.
    srng = random.Random(seed * 3 + 2 + (1 << 41))
    if srng.random() < 0.15:
        extra.append(Fault(srng.uniform(0.0, s.nominal_s * 1.2 + 0.5), "storage_slow", duration_s=srng.uniform(5.0, 40.0),
                           latency_s=srng.uniform(6.0, 15.0)))
    spec, tier_faults = _tier(seed, s) if tier else (None, [])
    # A run kept in memory only, on what shrank to one failure domain, has each commit refused: with endless
    # retries it never ends, as it is told.
    retries = 10 if spec is not None and spec.checkpoint_storage == "memory" and s.max_failures < 0 else s.max_failures
    return Schedule(**{**s.__dict__, "tier": spec, "max_failures": retries,
                       "faults": sorted(s.faults + extra + tier_faults, key=lambda f: f.at)})


def _tier(seed: int, s: Schedule) -> tuple[TierSpec | None, list[Fault]]:
    """Memory tiers on the nodes, in either mode, with budgets that evict, faults that corrupt copies in RAM and
    that take the nodes holding one: from a stream of their own, so that the rest of the schedule stays as it is."""
    rng = random.Random(seed * 5 + 3 + (1 << 44))
    rng.random()
    domains = rng.choice([0, 0, 0, 2])
    # Memory only where the cluster starts with two failure domains: elsewhere every commit is refused.
    mode = rng.choice(["storage", "memory", "memory"]) if s.nodes > 1 else "storage"
    spec = TierSpec(checkpoint_storage=mode, budget_copies=rng.choice([10_000, 10_000, 8, 6]), domains=domains)
    faults = []
    for _ in range(rng.choice([0, 1, 1, 2])):
        faults.append(Fault(rng.uniform(0.0, s.nominal_s * 1.2 + 0.5), rng.choice(["corrupt_copy", "lose_holders"]),
                            target=rng.randrange(8)))
    return spec, faults


def _draw(seed: int, elastic: bool) -> Schedule:
    rng = random.Random(seed)
    world = rng.choice([1, 1, 2, 2, 2, 3, 4])
    step_s = math.exp(rng.uniform(math.log(0.001), math.log(60.0)))
    steps = max(3, min(12, int(30.0 / step_s)))
    asks = rng.random() < 0.75
    loop = LoopSpec(world_size=world, step_s=step_s, steps=steps, asks=asks, jit=asks and rng.random() < 0.8,
                    return_on_notice=asks and rng.random() < 0.25, report_every=rng.choice([1, 1, 2]),
                    checkpoint_every=rng.choice([1, 2, 3, 5]), sharded=rng.random() < 0.5,
                    done_lost=rng.random() < 0.15, async_upload=rng.random() < 0.2)
    cpus = rng.choice([1, 1, 1, 2])
    nodes = math.ceil(world / cpus) + rng.choice([0, 1, 1, 2, 3])
    nominal = steps * step_s
    faults = []
    for _ in range(rng.choice([0, 1, 1, 2, 2, 3])):
        kind = rng.choice(KINDS)
        at = rng.uniform(0.0, nominal * 1.2 + 0.5)
        deadline = rng.choice([None, 0.0, rng.uniform(0.5, 30.0), rng.uniform(10.0, 120.0)])
        if kind == "double_drain":
            gap = rng.uniform(0.0, 2.0)
            faults.append(Fault(at, "drain", rng.randrange(nodes), deadline))
            faults.append(Fault(at + gap, "drain", rng.randrange(nodes), rng.choice([None, rng.uniform(0.0, 30.0)])))
            continue
        faults.append(Fault(at, kind, target=rng.randrange(max(world, nodes)), deadline_s=deadline,
                            duration_s=rng.uniform(0.1, 20.0)))
    low, interval = 0, 0.0
    if elastic:
        erng = random.Random(seed ^ 0xE1A5)
        low, interval = erng.randint(1, world), erng.choice([0.0, 0.0, 5.0, 60.0])
        nodes = max(1, nodes - erng.choice([0, 1, 2]))  # often starting below max_workers, to grow
        faults += [Fault(erng.uniform(0.0, nominal * 1.2 + 0.5), "add_node") for _ in range(erng.choice([0, 1, 1, 2]))]
    return Schedule(
        min_workers=low, resize_interval_s=interval,
        seed=seed, loop=loop, nodes=nodes, cpus_per_node=cpus, strategy=rng.choice(["SPREAD", "PACK"]),
        max_failures=rng.choice([-1, -1, 3, 10]), num_to_keep=rng.choice([None, 1, 2]),
        max_delay_s=rng.choice([0.0, 0.002, 0.02, 0.1]), storage_latency_s=rng.choice([0.0, 0.0, 0.01, 0.5]),
        refuse_deletes=rng.random() < 0.15, faults=sorted(faults, key=lambda f: f.at),
    )


def _edges(seed: int, s: Schedule) -> Schedule:
    rng = random.Random(seed * 3 + 7 + (1 << 41))
    loop = LoopSpec(**{**s.loop.__dict__, "children": rng.choice([0, 0, 1, 2]),
                       "exit_loses_messages": rng.random() < 0.5})
    extra: list[Fault] = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        kind, at = rng.choice(EDGE_KINDS), rng.uniform(0.0, s.nominal_s * 1.2 + 0.5)
        target = rng.randrange(max(s.loop.world_size, s.nodes))
        if kind in ("drain_then_fail", "grow_then_fail"):
            then = rng.choice(FAIL_KINDS)
            other = rng.randrange(max(s.loop.world_size, s.nodes))
            if kind == "drain_then_fail":
                extra += [Fault(at, "drain", target, rng.choice([None, rng.uniform(0.5, 30.0)])),
                          Fault(at + rng.uniform(0.0, 3.0), then, target=other)]
            else:  # the failure waits for the grow's notice, then strikes within its window
                extra += [Fault(at, "add_node"), Fault(at, "arm_in_grow", other, duration_s=rng.uniform(0.0, 0.1),
                                                        deadline_s=float(FAIL_KINDS.index(then)))]
        elif kind == "unkillable":  # and then a failure that needs it gone: a peer's death, or Ctrl+C
            extra.append(Fault(at, kind, target, duration_s=rng.choice([float("inf"), rng.uniform(1.0, 30.0)])))
            peer = (target + 1) % s.loop.world_size
            extra.append(Fault(at + rng.uniform(0.0, 3.0), "kill_worker" if peer != target % s.loop.world_size
                               else "interrupt", peer))
        else:
            extra.append(Fault(at, kind, target))
    # A newer outlast drives the run while this one's driver is dead: from a stream of its own again.
    vrng = random.Random(seed * 7 + 17 + (1 << 43))
    if vrng.random() < 0.06:
        at = vrng.uniform(0.0, s.nominal_s * 1.2 + 0.5)
        extra += [Fault(at, "driver_death"), Fault(at + vrng.uniform(0.0, 5.0), "newer_document",
                                                   target=vrng.randrange(len(NEWER_DOCUMENTS)))]
    return Schedule(**{**s.__dict__, "loop": loop, "faults": sorted(s.faults + extra, key=lambda f: f.at)})


LIVE_POINTS = ("forward", "before_allreduce", "after_allreduce", "voted", "committed", "awaiting", "forming", "sending",
               "receiving")
SHARD_POINTS = ("gather",)  # a sharded run's ranks also die in the gather after a committed step
# An FSDP2 run's ranks (`LoopSpec.mesh`) die in the forward's gathers of the parameters ("gather"), between the
# backward's reduce-scatter in the replica and its all-reduce across the replicas ("scattered"), and while the mesh's
# groups of a new generation form ("attach").
MESH_POINTS = ("attach", "scattered")


def draw_live(seed: int) -> Schedule:
    """A run with live recovery: the loop and cluster of `_draw`, and faults that kill ranks at each point of a
    live step (`kill_at`, with `LIVE_POINTS`), two at once, a replacement during its transfer, and sometimes a
    node. No driver dies and storage does not fail: the faults are the ranks'. Some runs split the optimizer's state
    in shards (`_sharded`); some drain a rank's node or grow (`_planned`)."""
    base = _draw(seed, False)
    rng = random.Random(seed * 11 + 5 + (1 << 45))
    # Rank 0's checkpoints alone (`sharded` off), as a data-parallel loop saves them: a sharded checkpoint's commit
    # can miss a replacement's shard, whose first report may come after the survivors' of the same step.
    loop = LoopSpec(**{**base.loop.__dict__, "world_size": rng.choice([1, 2, 2, 3, 3, 4]), "asks": False,
                       "sharded": False,
                       "jit": False, "return_on_notice": False, "done_lost": False, "async_upload": False,
                       "steps": rng.randint(6, 14), "step_s": rng.choice([0.01, 0.1, 1.0, rng.uniform(0.01, 5.0)])})
    nominal = loop.steps * loop.step_s
    faults: list[Fault] = []
    for _ in range(rng.choice([1, 1, 2, 2, 3, 4])):
        at = rng.uniform(0.0, nominal * 1.1 + 0.5)
        shape = rng.random()
        point = rng.choice(LIVE_POINTS)
        target = rng.randrange(loop.world_size)
        if shape < 0.6:
            faults.append(Fault(at, "kill_at", target, point=point))
        elif shape < 0.75:  # two ranks at the same point of the same step
            other = (target + 1 + rng.randrange(max(1, loop.world_size - 1))) % loop.world_size
            faults += [Fault(at, "kill_at", target, point=point), Fault(at, "kill_at", other, point=point)]
        elif shape < 0.9:  # a rank now, and the next rank that receives the state as it does (its replacement's)
            faults += [Fault(at, "kill_at", target, point=point),
                       Fault(at, "kill_at", -1, point="receiving")]
            if rng.random() < 0.5:  # and the one after it: the bound on deaths in a transfer
                faults += [Fault(at, "kill_at", -1, point="receiving") for _ in range(rng.choice([1, 2]))]
        elif shape < 0.95:
            faults.append(Fault(at, "kill_worker", target))
            faults.append(Fault(at, "kill_worker", (target + 1) % loop.world_size))
        else:
            faults.append(Fault(at, "lose_node", rng.randrange(base.nodes)))
    # Half the runs that lose a node are elastic, so that a node lost with no room elsewhere shrinks the group live.
    # Drawn apart, so that the other schedules stay what their seeds drew before.
    elastic = random.Random(seed * 13 + 9 + (1 << 46))
    low = 0
    if loop.world_size > 1 and any(f.kind == "lose_node" for f in faults) and elastic.random() < 0.5:
        low = elastic.randint(1, loop.world_size - 1)
    loop, shard_faults = _sharded(seed, loop)
    loop, mesh_faults = _meshed(seed, loop)
    if loop.shards > 1:
        # A sharded world keeps its layout: it does not shrink, and a restart of an elastic run at another number of
        # ranks would fail in the loop (FlatShards, or live_mesh: the world in whole replicas).
        low = 0
    faults += shard_faults + mesh_faults
    nodes = max(base.nodes, -(-loop.world_size // base.cpus_per_node))
    nodes, low, planned = _planned(seed, loop, nodes, base.cpus_per_node, low)
    return Schedule(**{**base.__dict__, "loop": loop, "live": True, "min_workers": low, "resize_interval_s": 0.0,
                       "max_failures": rng.choice([-1, -1, 3, 10]), "storage_latency_s": 0.0,
                       "refuse_deletes": False, "nodes": nodes, "faults": sorted(faults + planned, key=lambda f: f.at)})


GROW_POINTS = ("forward", "after_allreduce", "voted", "committed")


def _planned(seed: int, loop: LoopSpec, nodes: int, cpus: int, low: int) -> tuple[int, int, list[Fault]]:
    """Planned changes, from a stream of their own, so that the other schedules stay what their seeds drew before:
    drains of a rank's node as the rank reaches a point of its step (`drain_at`, with a deadline or none), on a
    cluster with room elsewhere for its ranks or none, half of those runs elastic (so that a drain with no room
    leaves the group live); and elastic runs that start below their size, to grow as nodes join at a point of a
    step (`grow_at`; a sharded run by whole replicas). Returns the nodes, min_workers and
    the faults."""
    rng = random.Random(seed * 19 + 13 + (1 << 48))
    world, nominal = loop.world_size, loop.steps * loop.step_s
    faults: list[Fault] = []
    shape = rng.random()
    if shape < 0.3:  # drains
        nodes = -(-world // cpus) + rng.choice([0, 0, 1, 2])
        if low == 0 and world > 1 and loop.shards == 1 and rng.random() < 0.5:
            low = rng.randint(1, world - 1)
        for _ in range(rng.choice([1, 1, 2])):
            deadline = rng.choice([None, rng.uniform(0.0, 3.0), rng.uniform(3.0, 30.0), rng.uniform(30.0, 120.0)])
            faults.append(Fault(rng.uniform(0.0, nominal * 0.9), "drain_at", rng.randrange(world), deadline,
                                point=rng.choice(LIVE_POINTS + (SHARD_POINTS if loop.shards > 1 else ()))))
    elif shape < 0.5 and world > 1 and cpus % loop.shards == 0:  # grows
        # A sharded run on nodes that each hold whole replicas: an elastic run placed on another number of ranks
        # would fail in the loop (FlatShards), its size not told to the controller before its group forms.
        low = loop.shards if loop.shards > 1 else rng.randint(1, world - 1)
        first, full = -(-low // cpus), -(-world // cpus)
        if first < full:
            nodes = rng.randint(first, full - 1)
            for _ in range(rng.choice([1, 1, 2, 3])):
                faults.append(Fault(rng.uniform(0.0, nominal * 0.9), "grow_at", rng.randrange(world),
                                    point=rng.choice(GROW_POINTS)))
        elif loop.shards > 1:
            low = 0
    return nodes, low, faults


def _meshed(seed: int, loop: LoopSpec) -> tuple[LoopSpec, list[Fault]]:
    """Some runs (a fifth or so) train an FSDP2 model over `live_mesh(shards)` (`LiveTraining(mesh=...)`): whole, or
    in the shards `_sharded` drew, and a run of 2 or 4 whole ranks often as 2 replicas of 2 shards; its ranks die
    besides in the forward's gathers and as the mesh's groups form. From a stream of its own, so that the other
    schedules stay what their seeds drew before (an elastic one among them stays elastic: its controller must not
    shrink it live)."""
    rng = random.Random(seed * 23 + 19 + (1 << 49))
    if rng.random() >= 0.22:
        return loop, []
    shards, world = loop.shards, loop.world_size
    if shards == 1 and world in (2, 4) and rng.random() < 0.5:
        shards, world = 2, 4
    nominal = loop.steps * loop.step_s
    faults = [Fault(rng.uniform(0.0, nominal * 1.1 + 0.5), "kill_at", rng.randrange(-1, world),
                    point=rng.choice(MESH_POINTS + SHARD_POINTS)) for _ in range(rng.choice([0, 1, 1, 2]))]
    return LoopSpec(**{**loop.__dict__, "world_size": world, "shards": shards, "mesh": True}), faults


def _sharded(seed: int, loop: LoopSpec) -> tuple[LoopSpec, list[Fault]]:
    """Some runs of 2, 3 or 4 ranks split the optimizer's state in 2 or 3 shards (`LiveTraining(shards=...)`): a
    world of one replica is often doubled, so that a shard keeps a holder when one rank dies; and ranks die in the
    gather after a committed step too. From a stream of its own, so that the other schedules stay what their seeds
    drew before."""
    rng = random.Random(seed * 17 + 11 + (1 << 47))
    if loop.world_size < 2 or rng.random() >= 0.35:
        return loop, []
    shards = 3 if loop.world_size == 3 else 2
    world = loop.world_size if loop.world_size > shards else shards * rng.choice([1, 2, 2])
    nominal = loop.steps * loop.step_s
    faults = [Fault(rng.uniform(0.0, nominal * 1.1 + 0.5), "kill_at", rng.randrange(-1, world), point="gather")
              for _ in range(rng.choice([0, 1, 1, 2]))]
    return LoopSpec(**{**loop.__dict__, "world_size": world, "shards": shards}), faults
