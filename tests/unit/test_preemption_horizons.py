from outlast.controller.preemption import Decision, Grant, HorizonBook


def test_the_first_query_grants_one_call_until_a_call_rate_is_known():
    book = HorizonBook()
    assert book.on_query(rank=0, index=0, now=10.0) == Grant(1)


def test_horizons_are_sized_so_a_notice_arrives_within_the_target_latency():
    book = HorizonBook(target_latency_s=0.5)
    book.on_query(0, 0, now=0.0)
    grant = book.on_query(0, 100, now=1.0)  # 100 calls per second
    assert grant == Grant(100 + 50)


def test_a_notice_freezes_the_decision_at_the_highest_horizon_ever_granted():
    book = HorizonBook(target_latency_s=0.5)
    book.on_query(0, 0, now=0.0)
    book.on_query(1, 0, now=0.0)
    book.on_query(0, 100, now=1.0)  # rank 0 -> 150
    book.on_query(1, 90, now=1.0)  # rank 1 -> 135
    assert book.preempt() == 150
    assert book.preempt() == 150  # a second notice changes nothing
    assert book.on_query(1, 135, now=1.2) == Decision(150)
    assert book.on_query(0, 150, now=1.3) == Decision(150)


def test_a_notice_before_any_query_is_seen_on_the_very_first_call():
    book = HorizonBook()
    assert book.preempt() == 0
    assert book.on_query(0, 0, now=0.0) == Decision(0)


def test_every_rank_sees_the_notice_on_the_same_call_whatever_its_own_horizon():
    """Simulate ranks that call at different rates; each returns None below D and the notice from D."""
    book = HorizonBook(target_latency_s=0.25)
    horizons = {0: 0, 1: 0, 2: 0}
    first_notice = {}
    rates = {0: 1000.0, 1: 400.0, 2: 50.0}
    decided = None
    for tick in range(4000):
        now = tick / 1000.0
        if tick == 2500:
            decided = book.preempt()
        for rank, rate in rates.items():
            calls = int(now * rate)
            while horizons[rank] <= calls and rank not in first_notice:
                answer = book.on_query(rank, horizons[rank], now)
                if isinstance(answer, Decision):
                    first_notice[rank] = answer.decision_index
                    break
                horizons[rank] = answer.horizon
    assert decided is not None and set(first_notice.values()) == {decided}
    # No rank was ever told it may answer None at or beyond D without asking again.
    assert all(h <= decided for h in horizons.values())


def test_the_step_never_exceeds_its_cap():
    book = HorizonBook(target_latency_s=10.0, max_step=64)
    book.on_query(0, 0, now=0.0)
    assert book.on_query(0, 1_000_000, now=1.0) == Grant(1_000_000 + 64)
