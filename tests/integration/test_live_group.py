"""A live group outlives the SIGKILL of any rank, rank 0 included: real processes, gloo on CPU.

The test process plays the controller: it holds the store, starts the members and a spare,
kills a member stopped at a phase of a step, and publishes the next generation with the spare in
the dead member's rank. The survivors keep their pids, their pending allreduce raises (a
connection error, not a timeout), the spare receives the state, and every rank ends with the
weights of a run in which nothing failed.
"""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from pathlib import Path

import pytest

from outlast.train.live import rendezvous
from outlast.protocol.membership import first_membership, replace_members
from tests.integration.procs import wait_until

STEPS = 6
FORKS = mp.get_context("forkserver")


def start(port: int, member: str, out: Path, pause: tuple[int, str] | None = None) -> mp.process.BaseProcess:
    """Forked from a fork server that imported torch once, as outlast's fork server forks its
    workers: a member starts in milliseconds instead of importing torch for seconds. (Not forked
    from this process: its store's threads would leave a child a lock held forever.)"""
    from tests.integration.live_group_jobs import main

    FORKS.set_forkserver_preload(["torch", "tests.integration.live_group_jobs"])
    p = FORKS.Process(target=main, args=(port, member, str(out), STEPS, *(pause or (None, None))),
                                       name=member)
    p.start()
    return p


def finish(procs: dict[str, mp.process.BaseProcess], out: Path) -> dict[str, dict]:
    import torch

    for member, p in procs.items():
        p.join(timeout=90)
        assert p.exitcode == 0, f"{member} ended with {p.exitcode} (its traceback is in the captured stderr)"
    return {m: torch.load(out / f"{m}.pt", weights_only=False) for m in procs}


def store_master():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def run_without_failures(world: int, out: Path) -> dict:
    store = store_master()
    members = [f"w{r}" for r in range(world)]
    procs = {m: start(store.port, m, out) for m in members}
    rendezvous.publish(store, first_membership(members))
    return finish(procs, out)["w0"]["model"]


@pytest.fixture(scope="module")
def clean_weights(tmp_path_factory):
    """The final weights of an undisturbed run, by world size."""
    return {world: run_without_failures(world, tmp_path_factory.mktemp(f"clean{world}")) for world in (2, 3, 4)}


def run_with_a_kill(world: int, victim: int, phase: str, out: Path, at_step: int = 2):
    store = store_master()
    members = [f"w{r}" for r in range(world)]
    procs = {m: start(store.port, m, out, (at_step, phase) if r == victim else None) for r, m in enumerate(members)}
    spare = start(store.port, "spare", out)  # waits, warm, for a generation that names it
    first = first_membership(members)
    rendezvous.publish(store, first)
    wait_until(lambda: store.check([f"paused/w{victim}"]), 120, f"w{victim} to stop at {phase}")
    dead = procs.pop(f"w{victim}")
    dead.kill()  # SIGKILL
    dead.join()
    rendezvous.publish(store, replace_members(first, {f"w{victim}": "spare"}))
    pids = {m: p.pid for m, p in procs.items()}
    ends = finish({**procs, "spare": spare}, out)
    return pids, ends


@pytest.mark.torch
@pytest.mark.parametrize("victim,phase", [(0, "allreduce"), (1, "allreduce"), (0, "vote"), (1, "apply")])
def test_two_ranks_go_on_through_a_kill_and_end_with_the_weights_of_a_run_without_one(
        tmp_path, clean_weights, victim, phase):
    import torch

    pids, ends = run_with_a_kill(2, victim, phase, tmp_path)
    survivor = f"w{1 - victim}"
    assert ends[survivor]["pid"] == pids[survivor], "the survivor was restarted"
    assert len(ends[survivor]["breaks"]) == 1
    broke = ends[survivor]["breaks"][0]
    if phase == "allreduce":
        # Its pending allreduce raised because the peer's sockets closed, not at a timeout.
        assert broke["step"] == 2 and "Timed out" not in broke["error"] and "allreduce" in broke["error"]
    # "vote": the survivor reduced step 2 but the verdict was ABORT; "apply": step 2 was
    # committed, so the survivor applied it and the break came in step 3.
    assert broke["step"] == (3 if phase == "apply" else 2)
    joined = ends["spare"]["joins"][0]
    assert joined["rank"] == victim and joined["generation"] == 1 and joined["state_bytes"] > 0
    assert joined["committed"] == (2 if phase == "apply" else 1)
    for member, end in ends.items():
        for name, want in clean_weights[2].items():
            assert torch.equal(end["model"][name], want), f"{member}'s {name} differs from the run without failures"


@pytest.mark.torch
@pytest.mark.parametrize("world,victim,phase", [(3, 0, "allreduce"), (3, 2, "vote"), (4, 1, "allreduce")])
def test_more_ranks_go_on_through_a_kill_and_end_with_the_weights_of_a_run_without_one(
        tmp_path, clean_weights, world, victim, phase):
    import torch

    pids, ends = run_with_a_kill(world, victim, phase, tmp_path)
    for member, pid in pids.items():
        assert ends[member]["pid"] == pid and [b["step"] for b in ends[member]["breaks"]] == [2]
        if phase == "allreduce":
            # At 4 ranks, rank 3's part of the allreduce waits on ranks 0 and 2, not on the lost rank 1: it is
            # released when their failed group closes, not at its timeout.
            assert "Timed out" not in ends[member]["breaks"][0]["error"], (member, ends[member]["breaks"])
    assert ends["spare"]["joins"][0]["rank"] == victim
    for member, end in ends.items():
        for name, want in clean_weights[world].items():
            assert torch.equal(end["model"][name], want), f"{member}'s {name} differs from the run without failures"


@pytest.mark.torch
def test_a_rank_waiting_on_a_survivor_is_released_while_the_survivor_still_handles_the_failure(tmp_path):
    """Four members, rank 1 lost in an allgather: rank 3 waits on ranks 0 and 2, not on rank 1. They stay in their
    handler of the failure (as a loop that joins the next group from there does), and rank 3's allgather fails all
    the same, on its peers' closed connections, not at the group's timeout."""
    from tests.integration.live_group_jobs import held_break

    store = store_master()
    FORKS.set_forkserver_preload(["torch", "tests.integration.live_group_jobs"])
    procs = [FORKS.Process(target=held_break, args=(store.port, rank, str(tmp_path))) for rank in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=150)
        assert p.exitcode == 0
    said = {rank: (tmp_path / f"{rank}.txt").read_text() for rank in (0, 2, 3)}
    assert all("allgather failed" in s for s in said.values()), said
    assert "Timed out" not in said[3] and "timed out" not in said[3].lower(), said[3]
