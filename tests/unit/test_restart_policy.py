"""When a dead fork server comes back: at once, after a growing wait, or never, with a reason."""

from __future__ import annotations

from outlast.client.restarts import GiveUp, Restart, RestartPolicy, describe_exit


def test_the_first_death_restarts_at_once_however_young_the_server():
    p = RestartPolicy()
    d = p.on_death(2.0, "killed by SIGKILL")
    assert d == Restart(2.0, d.reason) and "killed by SIGKILL" in d.reason


def test_deaths_soon_after_each_restart_back_off_then_give_up_with_every_cause():
    p = RestartPolicy(soon_s=30.0, max_quick_deaths=3, backoff_s=1.0)
    now = 100.0
    p.on_death(now, "killed by SIGKILL")
    p.restarted(now)
    waits = []
    for i in range(3):
        now += 5.0
        d = p.on_death(now, f"exit code {i + 1}")
        assert isinstance(d, Restart)
        waits.append(d.at - now)
        p.restarted(d.at)
        now = d.at
    assert waits == [1.0, 2.0, 4.0]
    d = p.on_death(now + 1.0, "exit code 9")
    assert isinstance(d, GiveUp)
    assert "4 times in a row" in d.reason and "exit code 1, exit code 2, exit code 3, exit code 9" in d.reason


def test_a_server_that_lived_long_starts_the_count_again():
    p = RestartPolicy(soon_s=30.0, max_quick_deaths=1)
    p.on_death(0.0, "a")
    p.restarted(0.0)
    assert isinstance(p.on_death(1.0, "b"), Restart)  # one quick death: backed off
    p.restarted(2.0)
    d = p.on_death(100.0, "c")  # lived 98 s: healthy again
    assert d == Restart(100.0, d.reason)
    p.restarted(100.0)
    assert isinstance(p.on_death(101.0, "d"), Restart)
    p.restarted(103.0)
    assert isinstance(p.on_death(104.0, "e"), GiveUp)


def test_the_backoff_is_capped():
    p = RestartPolicy(max_quick_deaths=20, backoff_s=1.0, max_backoff_s=8.0)
    p.on_death(0.0, "x")
    p.restarted(0.0)
    now, waits = 0.0, []
    for _ in range(6):
        d = p.on_death(now + 0.1, "x")
        waits.append(d.at - (now + 0.1))
        now = d.at
        p.restarted(now)
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_exits_are_described_by_signal_name_or_code():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(None) == "exit status unknown"
