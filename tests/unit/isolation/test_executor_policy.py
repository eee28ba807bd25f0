from outlast.executor.errors import OutOfMemoryError
from outlast.executor.policy import RetryConfig, RetryVerdict, on_failure, on_oom_kill
from outlast.protocol.messages import KillReport


def test_memory_kills_retry_without_limit_by_default_with_growing_backoff():
    cfg = RetryConfig(oom_backoff_s=0.5, oom_backoff_max_s=4)
    delays = [on_oom_kill(n, cfg).delay_s for n in range(1, 7)]
    assert all(on_oom_kill(n, cfg).verdict is RetryVerdict.RETRY for n in range(1, 100))
    assert delays == [0.5, 1, 2, 4, 4, 4]


def test_memory_kills_fail_once_their_own_budget_is_spent():
    cfg = RetryConfig(max_oom_retries=2)
    assert on_oom_kill(2, cfg).verdict is RetryVerdict.RETRY
    out = on_oom_kill(3, cfg)
    assert out.verdict is RetryVerdict.FAIL and "max_oom_retries=2" in out.reason


def test_crashes_use_max_retries_and_exceptions_are_answers_unless_asked():
    cfg = RetryConfig(max_retries=1)
    assert on_failure(1, cfg, raised=False).verdict is RetryVerdict.RETRY
    assert on_failure(2, cfg, raised=False).verdict is RetryVerdict.FAIL
    assert on_failure(1, cfg, raised=True).verdict is RetryVerdict.FAIL
    assert on_failure(1, RetryConfig(max_retries=1, retry_exceptions=True), raised=True).verdict is RetryVerdict.RETRY


def test_out_of_memory_error_carries_its_reports_and_pickles():
    import pickle

    r = KillReport(node_id="n", time=1.0, trigger="t", usage_bytes=1, limit_bytes=2, node_total_bytes=3,
                   target_bytes=1, policy="p", considered=[], selected=["task-1"], reason="why")
    e = pickle.loads(pickle.dumps(OutOfMemoryError("killed", [r])))
    assert e.kill_report == r and str(e) == "killed"


def test_admission_shrinks_to_what_survived_a_memory_kill_and_grows_back_slowly():
    from outlast.executor.policy import window_after_oom_kill, window_after_success

    assert window_after_oom_kill(8.0, 3) == 3.0
    assert window_after_oom_kill(8.0, 0) == 1.0  # never stops admitting
    w = 3.0
    for _ in range(3):
        w = window_after_success(w, 8)
    assert 3.9 < w < 4.1  # about one more per window of completions
    assert window_after_success(8.0, 8) == 8.0
