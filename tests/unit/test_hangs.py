"""Hangs, decided: the adaptive limit, who is stuck, and the one message that says where everyone is."""

from __future__ import annotations

import math

from outlast.controller.hangs import FLOOR_S, HangWatch, group_stacks
from outlast.protocol import messages as m


def dump(rank, where, thread="0x7f00aa"):
    return m.StackDump(attempt=1, rank=rank, where=where,
                       text=f"Current thread {thread} (most recent call first):\n  File \"x.py\", line 3 in {where}\n")


def test_the_adaptive_limit_is_ten_slowest_steps_and_never_under_five_minutes():
    w = HangWatch(1, 2, None, started=0.0)
    assert w.limit_s() == FLOOR_S
    for t in range(1, 50):  # 20 ms steps
        w.on_progress(0, t, t * 0.02)
    assert w.limit_s() == FLOOR_S
    w.on_progress(0, 100, 0.98 + 60.0)  # one 60 s step
    assert math.isclose(w.limit_s(), 600.0)
    assert HangWatch(1, 2, 7.5, 0.0).limit_s() == 7.5


def test_a_rank_without_progress_is_found_once_and_every_live_rank_is_asked():
    w = HangWatch(1, 3, 10.0, started=0.0)
    for t in range(1, 30):
        w.on_progress(0, t, float(t))
        w.on_progress(2, t, float(t))
    w.on_progress(1, 1, 1.0)
    assert w.check([0, 1, 2], 10.0) is None
    hang = w.check([0, 1, 2], 11.5)
    assert hang is not None and hang.ranks == [1] and hang.quiet_s == 10.5
    assert w.asked == [0, 1, 2] and w.check([0, 1, 2], 20.0) is None  # found once
    assert not w.explained(11.5)
    for r, where in ((0, "all_reduce (distributed_c10d.py:2806)"), (2, "all_reduce (distributed_c10d.py:2806)")):
        w.on_dump(dump(r, where))
    assert not w.explained(12.0)
    w.on_dump(dump(1, "next_batch (loader.py:41)"))
    assert w.explained(12.0)
    summary = w.record(1e9).summary
    assert summary.startswith("rank 1 made no progress for 10 s (FailureConfig.hang_timeout_s=10)")
    assert "rank 1 is in next_batch (loader.py:41), while ranks [0, 2] wait in all_reduce" in summary


def test_ranks_that_never_answer_are_named_after_the_wait():
    w = HangWatch(1, 2, 5.0, started=0.0)
    w.check([0, 1], 6.0)
    w.on_dump(dump(0, "all_reduce (c10d.py:1)"))
    assert not w.explained(7.0) and w.explained(16.0)
    assert "rank 1 sent no stacks" in w.record(0.0).summary


def test_a_thousand_ranks_in_one_all_reduce_keep_one_stack():
    dumps = {r: dump(r, "all_reduce (c10d.py:1)", thread=hex(0x7f0000 + r)) for r in range(1000)}
    dumps[517] = dump(517, "sleep_forever (train.py:9)")
    groups = group_stacks(dumps)
    assert sorted(len(g.ranks) for g in groups) == [1, 999]
    w = HangWatch(1, 1000, 5.0, started=0.0)
    w.check(list(range(1000)), 6.0)
    for d in dumps.values():
        w.on_dump(d)
    summary = w.record(0.0).summary
    assert "rank 517 is in sleep_forever (train.py:9), while ranks [0, 1, 2, 3, ..., 998, 999] (999 ranks) wait" \
        in summary


def test_a_watch_that_skips_its_calm_checks_finds_every_hang_one_that_never_skips_finds():
    import random

    rng = random.Random(7)
    for timeout in (None, 4.0):
        for _ in range(50):
            skips, full = HangWatch(1, 4, timeout, started=0.0), HangWatch(1, 4, timeout, started=0.0)
            live, counts, now = [0, 1, 2, 3], [0] * 4, 0.0
            for _ in range(200):
                now += rng.choice([0.01, 0.5, 3.0, 40.0, 200.0])
                r = rng.randrange(4)
                if rng.random() < 0.7:  # progress; a rank that stops for good; the floor and the limit grow
                    counts[r] += 1
                    skips.on_progress(r, counts[r], now)
                    full.on_progress(r, counts[r], now)
                elif rng.random() < 0.1 and len(live) > 1:
                    live.remove(live[rng.randrange(len(live))])
                full.calm_until = -math.inf
                found, expected = skips.check(live, now), full.check(live, now)
                assert found == expected
                if found is not None:
                    skips.hang = full.hang = None  # explained: the watch goes on
