from outlast.controller.preemption import Decision, Grant, HorizonBook


def test_a_grant_is_bounded_by_calls_and_by_time():
    book = HorizonBook(valid_s=0.25, max_step=1000)
    assert book.on_query(rank=0, index=0, now=10.0) == Grant(1000, 0.25)
    assert book.on_query(rank=0, index=7, now=10.3) == Grant(1007, 0.25)  # asked again when it expired


def test_after_a_notice_ranks_are_held_until_every_rank_has_asked_then_all_get_one_d():
    book = HorizonBook(max_step=1000)
    book.on_query(0, 0, now=0.0)  # rank 0 may answer None up to call 999
    book.on_query(1, 0, now=0.0)
    assert book.preempt(now=1.0) is None  # both hold grants: D not known yet
    assert book.on_query(0, 40, now=1.1) == Grant(41, float("inf"))  # hold: ask on the next call
    assert book.on_query(0, 41, now=1.12) == Grant(42, float("inf"))
    assert book.on_query(1, 39, now=1.15) == Decision(42)  # rank 0 may have answered None up to 41
    assert book.on_query(0, 42, now=1.16) == Decision(42)
    assert book.preempt(now=2.0) == 42  # a second notice changes nothing


def test_a_silent_rank_is_bounded_by_its_last_grant_after_the_collect_time():
    book = HorizonBook(max_step=100, collect_s=0.5)
    book.on_query(0, 0, now=0.0)
    book.on_query(1, 5, now=0.0)  # rank 1: up to call 104
    book.preempt(now=1.0)
    book.on_query(0, 30, now=1.1)
    assert book.tick(now=1.2) is None
    assert book.tick(now=1.6) == 105
    assert book.on_query(0, 31, now=1.7) == Decision(105)


def test_a_lost_rank_is_not_waited_for():
    book = HorizonBook(max_step=100)
    book.on_query(0, 0, now=0.0)
    book.on_query(1, 0, now=0.0)
    book.preempt(now=1.0)
    book.lose_rank(1)
    assert book.on_query(0, 12, now=1.1) == Decision(13)


def test_a_notice_before_any_query_is_seen_on_the_very_first_call():
    book = HorizonBook()
    assert book.preempt(now=0.0) == 0
    assert book.on_query(0, 0, now=0.0) == Decision(0)


def test_every_rank_sees_the_notice_on_the_same_call_in_a_simulated_run():
    """Ranks at different rates, a burst of calls before the notice; each answers None below D and the
    notice from D, and none ever answered None at or past D."""
    book = HorizonBook(valid_s=0.25, max_step=1 << 20)
    rates = {0: 1000.0, 1: 400.0, 2: 50.0}
    state = {r: {"horizon": 0, "expires": 0.0, "answered_none_up_to": -1, "seen": None} for r in rates}
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
                answer = book.on_query(rank, i, now)
                if isinstance(answer, Decision):
                    s["seen"] = answer.decision_index
                    break
                s["horizon"], s["expires"] = answer.horizon, now + answer.valid_s
                s["answered_none_up_to"] = i
                i += 1
    seen = {s["seen"] for s in state.values()}
    assert len(seen) == 1 and None not in seen
    d = seen.pop()
    assert all(s["answered_none_up_to"] < d for s in state.values())
