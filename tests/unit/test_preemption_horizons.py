from outlast.controller.horizons import Answer, Grant, HorizonBook, NoticeAt


def test_a_grant_is_bounded_by_time_and_by_the_calls_the_rank_makes_in_that_time():
    book = HorizonBook(valid_s=0.25, max_step=1000)
    assert book.on_query(rank=0, index=0, now=10.0) == [Answer(0, 0, Grant(1, 0.25))]  # no rate known yet
    assert book.on_query(rank=0, index=500, now=10.5) == [Answer(0, 500, Grant(750, 0.25))]  # 1000 calls/s
    assert book.on_query(rank=0, index=750, now=10.5625) == [Answer(0, 750, Grant(1750, 0.25))]  # capped
    assert book.on_query(rank=0, index=751, now=12.5625) == [Answer(0, 751, Grant(752, 0.25))]  # slow: one call


def test_slow_loops_get_d_at_the_notice_their_next_call():
    book = HorizonBook()
    for t, i in ((0.0, 0), (2.0, 1), (4.0, 2)):
        book.on_query(0, i, now=t)
        book.on_query(1, i, now=t + 0.01)
    assert book.preempt(now=4.5) == []
    assert book.decision_index == 3
    assert book.on_query(1, 3, now=6.0) == [Answer(1, 3, NoticeAt(3))]


def test_fast_loops_are_held_while_a_peer_has_a_live_grant_then_get_the_next_call():
    book = HorizonBook(valid_s=0.25)
    for r in (0, 1):
        book.on_query(r, 0, now=0.0)
        book.on_query(r, 10, now=0.01)  # 1000 calls/s: grant up to 260, until 0.26
    assert book.preempt(now=0.1) == [] and book.decision_index is None  # a fast loop may have slowed since
    assert book.on_query(0, 200, now=0.2) == [Answer(0, 200, Grant(201, float("inf")))]  # rank 1's grant is live
    assert book.on_query(1, 201, now=0.21) == [Answer(1, 201, NoticeAt(201))]  # rank 0 asks at 201 next
    assert book.on_query(0, 201, now=0.21) == [Answer(0, 201, NoticeAt(201))]


def test_a_burst_then_a_long_step_waits_for_the_ranks_next_call_and_parks_those_that_ask():
    book = HorizonBook(valid_s=0.25)
    for r in (0, 1):
        book.on_query(r, 0, now=0.0)
        book.on_query(r, 10_000, now=0.1)  # a burst: a grant far ahead, expired by 0.35
    book.preempt(now=5.0)
    assert book.decision_index is None
    assert book.on_query(0, 10_001, now=7.0) == []  # parked: rank 1 asks at its next call, maybe 10_001 too
    assert book.on_query(1, 10_001, now=7.01) == [Answer(0, 10_001, NoticeAt(10_001)),
                                                  Answer(1, 10_001, NoticeAt(10_001))]


def test_ranks_that_asked_fall_back_to_the_horizons_when_a_rank_stays_silent():
    book = HorizonBook(valid_s=0.25, collect_s=1.0)
    for r in (0, 1):
        book.on_query(r, 0, now=0.0)
        book.on_query(r, 100, now=0.1)
    book.preempt(now=5.0)
    assert book.on_query(0, 101, now=7.0) == []
    assert book.tick(now=7.5) == []
    (answer,) = book.tick(now=8.0)
    assert answer == Answer(0, 101, NoticeAt(100 + 250))


def test_a_lost_rank_is_not_waited_for():
    book = HorizonBook(valid_s=0.25)
    for r in (0, 1):
        book.on_query(r, 0, now=0.0)
        book.on_query(r, 100, now=0.1)
    book.preempt(now=5.0)
    assert book.on_query(0, 101, now=5.1) == []
    assert book.lose_rank(1, now=5.2) == [Answer(0, 101, NoticeAt(101))]


def test_a_notice_before_any_query_is_seen_on_the_very_first_call():
    book = HorizonBook()
    assert book.preempt(now=0.0) == []
    assert book.on_query(0, 0, now=0.0) == [Answer(0, 0, NoticeAt(0))]


def test_every_rank_sees_the_notice_on_the_same_call_soon_after_it_in_a_simulated_run():
    """Ranks at different rates, a burst of calls before the notice; each answers None below D and the
    notice from D, none ever answered None at or past D, and each sees it within half a second."""
    book = HorizonBook(valid_s=0.25, max_step=1 << 20)
    rates = {0: 1000.0, 1: 1000.0, 2: 1000.0}
    state = {r: {"horizon": 0, "expires": 0.0, "answered_none_up_to": -1, "seen": None, "seen_at": None}
             for r in rates}
    notice_at = 2.5
    for tick in range(6000):
        now = tick / 1000.0
        if tick == 2500:
            book.preempt(now)
        book.tick(now)
        for rank, rate in rates.items():
            s = state[rank]
            calls = int(now * rate) + (10_000 if now >= 0.1 else 0)  # a burst at 0.1 s
            i = s["answered_none_up_to"] + 1
            while i <= calls and s["seen"] is None:
                if i < s["horizon"] and now < s["expires"]:
                    s["answered_none_up_to"] = i
                    i += 1
                    continue
                replies = [a.reply for a in book.on_query(rank, i, now) if a.rank == rank]
                assert replies, "a rank in lockstep is never left parked"
                if isinstance(replies[0], NoticeAt):
                    s["horizon"], s["expires"] = replies[0].decision_index, float("inf")
                    if i >= replies[0].decision_index:
                        s["seen"], s["seen_at"] = i, now
                        break
                else:
                    s["horizon"], s["expires"] = replies[0].horizon, now + replies[0].valid_s
                s["answered_none_up_to"] = i
                i += 1
    seen = {s["seen"] for s in state.values()}
    assert len(seen) == 1 and None not in seen
    d = seen.pop()
    assert all(s["answered_none_up_to"] < d for s in state.values())
    assert all(s["seen_at"] - notice_at <= 0.5 for s in state.values())
