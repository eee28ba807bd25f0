"""What interrupts a fleet's run: the Llama 3 mix, or failures drawn at a mean time to failure per node.

The mix is Table 5 of "The Llama 3 Herd of Models" (Llama Team, AI @ Meta, 2024, arXiv:2407.21783): the root
causes of the 419 unexpected interruptions of 54 days of Llama 3 405B's pre-training on 16,384 H100s, plus 47
planned ones. Each cause is mapped to what it does to an outlast run (`Effect`): a GPU or a host part that fails
takes its node out of the run until it is repaired; a software bug or silent data corruption fails a rank's process
on a node that stays usable; an NCCL watchdog timeout is a hang; a planned interruption is a drain with notice.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

SECONDS_PER_DAY = 86_400.0


class Effect(enum.Enum):
    RANK_DIES = "rank_dies"  # one rank's process fails; its node stays usable
    NODE_LOST = "node_lost"  # the node is gone without notice, until repaired
    HANG = "hang"  # the ranks stop making progress; nothing exits
    DRAIN = "drain"  # the node goes away after a notice (a cloud's preemption, a planned maintenance)


# Cause, interruptions in the 54 days, effect: Table 5 of the Llama 3 paper, in its order.
LLAMA3_UNEXPECTED: tuple[tuple[str, int, Effect], ...] = (
    ("faulty GPU", 148, Effect.NODE_LOST),
    ("GPU HBM3 memory", 72, Effect.NODE_LOST),
    ("software bug", 54, Effect.RANK_DIES),
    ("network switch/cable", 35, Effect.NODE_LOST),
    ("host maintenance (unplanned)", 32, Effect.NODE_LOST),
    ("GPU SRAM memory", 19, Effect.NODE_LOST),
    ("GPU system processor", 17, Effect.NODE_LOST),
    ("NIC", 7, Effect.NODE_LOST),
    ("NCCL watchdog timeout", 7, Effect.HANG),
    ("silent data corruption", 6, Effect.RANK_DIES),
    ("GPU thermal interface and sensor", 6, Effect.NODE_LOST),
    ("SSD", 3, Effect.NODE_LOST),
    ("power supply", 3, Effect.NODE_LOST),
    ("server chassis", 2, Effect.NODE_LOST),
    ("IO expansion board", 2, Effect.NODE_LOST),
    ("dependency", 2, Effect.RANK_DIES),
    ("CPU", 2, Effect.NODE_LOST),
    ("system memory", 2, Effect.NODE_LOST),
)
LLAMA3_PLANNED = 47  # automated maintenance: firmware upgrades, configuration and data set changes
LLAMA3_DAYS = 54.0
LLAMA3_NODES = 2048


@dataclass(frozen=True)
class Interruption:
    at_s: float  # seconds since the run began
    cause: str
    effect: Effect
    node: int  # the node it strikes, 0 .. nodes-1
    restart_s: float | None = None  # its restart's own time, as measured on a real run (None: the model's)


def llama3(nodes: int, days: float, rng: random.Random) -> list[Interruption]:
    """The mix's causes at the paper's rates per node-day, scaled to `nodes` and `days`: at 2,048 nodes and 54
    days, exactly the paper's counts; elsewhere each count scaled and rounded, its times drawn uniformly."""
    scale = nodes / LLAMA3_NODES * days / LLAMA3_DAYS
    causes = [*LLAMA3_UNEXPECTED, ("planned maintenance", LLAMA3_PLANNED, Effect.DRAIN)]
    out = []
    for cause, count, effect in causes:
        for _ in range(_scaled(count, scale, rng)):
            out.append(Interruption(rng.uniform(0.0, days * SECONDS_PER_DAY), cause, effect, rng.randrange(nodes)))
    return sorted(out, key=lambda i: (i.at_s, i.node))


def by_mttf(nodes: int, days: float, mttf_hours: float, drains_per_day: float,
            rng: random.Random) -> list[Interruption]:
    """Each node fails at exponential intervals of mean `mttf_hours` (the mix's unexpected causes, in its
    proportions), and `drains_per_day` drains come over the whole fleet at random."""
    if mttf_hours <= 0:
        raise ValueError(f"--mttf-hours must be positive, got {mttf_hours:g}")
    end = days * SECONDS_PER_DAY
    weights = [count for _, count, _ in LLAMA3_UNEXPECTED]
    out = []
    t = 0.0
    rate = nodes / (mttf_hours * 3600.0)  # the fleet's failures per second: nodes independent, memoryless
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            break
        cause, _, effect = rng.choices(LLAMA3_UNEXPECTED, weights)[0]
        out.append(Interruption(t, cause, effect, rng.randrange(nodes)))
    for _ in range(_scaled(round(drains_per_day * days), 1.0, rng)):
        out.append(Interruption(rng.uniform(0.0, end), "planned maintenance", Effect.DRAIN, rng.randrange(nodes)))
    return sorted(out, key=lambda i: (i.at_s, i.node))


def _scaled(count: int, scale: float, rng: random.Random) -> int:
    """`count * scale` as a whole number: its fraction rounds up with that chance, so the mean stays exact."""
    exact = count * scale
    whole = int(exact)
    return whole + (1 if rng.random() < exact - whole else 0)
