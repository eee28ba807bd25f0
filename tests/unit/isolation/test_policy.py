from outlast.isolation.policy import (
    Action, Cooldown, KillCandidate, MemorySample, PolicyConfig, cooldown_over, judge, rank_for_killing, render_report,
    WorkloadKind, work_at_risk,
)

MiB = 1024**2
NOW = 1000.0
CFG = PolicyConfig(kill_at=0.95, target=0.90)


def task(name, age, mem=100 * MiB, **kw):
    return KillCandidate(name=name, kind=WorkloadKind.TASK, owner=name, rank=None, pid=hash(name) % 10**6,
                         memory_bytes=mem, started_at=NOW - age, **kw)


def trainer(name, age, world, last_commit_ago=None, mem=100 * MiB, rank=0):
    return KillCandidate(name=name, kind=WorkloadKind.TRAINING, owner="run1", rank=rank, pid=hash(name) % 10**6,
                         memory_bytes=mem, started_at=NOW - age, run_world_size=world,
                         last_commit_at=None if last_commit_ago is None else NOW - last_commit_ago)


def sample(counted_mib, limit_mib=1000, stalled=False):
    return MemorySample(counted_bytes=counted_mib * MiB, limit_bytes=limit_mib * MiB, node_total_bytes=2000 * MiB,
                        stalled=stalled)


def test_a_task_risks_its_age_and_a_training_worker_its_run_since_the_last_commit():
    assert work_at_risk(task("t", 30), NOW) == 30
    assert work_at_risk(trainer("w", age=100, world=4, last_commit_ago=10), NOW) == 40
    assert work_at_risk(trainer("w", age=5, world=2, last_commit_ago=60), NOW) == 10  # restored after that commit
    assert work_at_risk(trainer("w", age=7, world=3), NOW) == 21  # no commit yet


def test_idle_workers_go_first_then_least_work_lost():
    order = rank_for_killing([task("old", 50), task("young", 5), task("idle", 500, idle=True)], NOW)
    assert [c.name for c in order] == ["idle", "young", "old"]


def test_a_training_worker_counts_its_whole_run():
    # 8 s since the commit x 4 workers = 32 s at risk: more than a 20 s task.
    order = rank_for_killing([trainer("w", age=100, world=4, last_commit_ago=8), task("t", 20)], NOW)
    assert [c.name for c in order] == ["t", "w"]


def test_non_retriable_tasks_go_last_whatever_their_age():
    order = rank_for_killing([task("precious", 1, retriable=False), task("old", 300)], NOW)
    assert [c.name for c in order] == ["old", "precious"]


def test_ties_go_to_the_newest():
    a = KillCandidate(name="a", kind=WorkloadKind.TRAINING, owner="r", rank=0, pid=1, memory_bytes=1,
                      started_at=NOW - 50, run_world_size=2, last_commit_at=NOW - 5)
    b = KillCandidate(name="b", kind=WorkloadKind.TRAINING, owner="r", rank=1, pid=2, memory_bytes=1,
                      started_at=NOW - 20, run_world_size=2, last_commit_at=NOW - 5)
    assert [c.name for c in rank_for_killing([a, b], NOW)] == ["b", "a"]


def test_below_the_threshold_nothing_is_killed():
    d = judge(sample(900), [task("t", 1)], NOW, CFG, "threshold", "n1")
    assert d.action is Action.NONE and "below the kill threshold" in d.reason


def test_enough_victims_are_killed_at_once_to_get_under_the_target():
    workers = [task("a", 10, mem=30 * MiB), task("b", 20, mem=30 * MiB), task("c", 30, mem=300 * MiB)]
    d = judge(sample(960), workers, NOW, CFG, "kernel event: memory.events (high)", "n1")
    # 960 - 900 = 60 MiB must go: a and b together, c keeps its 30 s of work.
    assert d.action is Action.KILL
    assert [v.name for v in d.victims] == ["a", "b"]


def test_a_stalled_cgroup_is_judged_even_below_the_threshold():
    d = judge(sample(500, stalled=True), [task("a", 10)], NOW, CFG, "memory.oom_control", "n1")
    assert d.action is Action.KILL


def test_with_nothing_of_ours_to_kill_the_decision_is_to_wait_and_say_why():
    d = judge(sample(990), [], NOW, CFG, "threshold", "n1")
    assert d.action is Action.WAIT and "other processes" in d.reason


def test_the_report_lists_everyone_considered_and_who_was_selected():
    workers = [task("hog", 2, mem=700 * MiB), trainer("w0", age=60, world=2, last_commit_ago=30)]
    d = judge(sample(980), workers, NOW, CFG, "kernel event: memory.events (high)", "node-7")
    r = d.report
    assert r.node_id == "node-7" and r.trigger.startswith("kernel event") and r.limit_bytes == 1000 * MiB
    assert r.selected == ["hog"]
    by_name = {w.name: w for w in r.considered}
    assert by_name["hog"].selected and not by_name["w0"].selected
    assert by_name["w0"].work_at_risk_s == 60 and by_name["w0"].owner == "run1" and by_name["w0"].rank == 0
    text = render_report(r)
    assert "KILLED hog" in text and "kept   w0" in text and "node-7" in text and "work at risk" in text


def test_after_a_kill_judging_waits_for_the_reap_and_for_memory_to_come_back():
    cool = Cooldown(victims=frozenset({5}), counted_at_kill=980 * MiB, expected_freed=200 * MiB)
    over, why = cooldown_over(cool, {5, 6}, sample(980), NOW, CFG)
    assert not over and "reaped" in why
    over, why = cooldown_over(cool, {6}, sample(970), NOW, CFG)
    assert not over and "come back" in why
    assert cooldown_over(cool, {6}, sample(800), NOW, CFG)[0]  # under the threshold again
    late = Cooldown(cool.victims, cool.counted_at_kill, cool.expected_freed, reaped_at=NOW - 5)
    assert cooldown_over(late, {6}, sample(975), NOW, CFG)[0]  # gave memory long enough


def test_one_worker_of_a_run_is_enough_and_it_is_the_biggest():
    hog = trainer("r0", age=10, world=2, mem=900 * MiB, rank=0)
    small = KillCandidate(name="r1", kind=WorkloadKind.TRAINING, owner="run1", rank=1, pid=77, memory_bytes=10 * MiB,
                          started_at=NOW - 9.99, run_world_size=2)
    d = judge(sample(990), [small, hog], NOW, CFG, "threshold", "n1")
    # Killing either restarts the run; the one holding the memory goes, its sibling is counted, not killed.
    assert [v.name for v in d.victims] == ["r0"]
    assert "run1 restart" in d.reason
