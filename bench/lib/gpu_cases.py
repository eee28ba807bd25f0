"""The cases of scripts/gpu-check: each starts its nodes, runs a loop of bench/lib/gpu_loops.py with
`use_gpu=True`, and returns (figures, problems); no problem is a pass. docs/gpu.md lists them."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from bench.lib import gpu_loops
from bench.lib.events import read_events


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[[str], tuple[dict, list[str]]]
    gpus: int  # the GPUs it needs
    limit_s: float


@contextmanager
def nodes(work: str, count: int = 1, gpus: int = 1):
    """A head that takes no workers and `count` nodes offering `gpus` GPUs each (the same devices:
    nodes on one machine share its GPUs, one run at a time)."""
    from outlast.testing import LocalCluster

    with LocalCluster(num_nodes=1, cpus_per_node=0, workdir=os.path.join(work, "cluster")) as cluster:
        for _ in range(count):
            cluster.add_node(extra_args=["--num-cpus", "4", "--num-gpus", str(gpus)])
        cluster.wait_ready()
        yield cluster


def status(cluster, node_id: str):
    from outlast.protocol import messages as m

    return cluster._request(cluster.nodes[node_id].address, m.StatusRequest())


def fit(work: str, loop, name: str, workers: int = 1, max_failures: int = 0, use_gpu: bool = True, **config):
    """Run `loop`; returns (its events, the run's history). A failed run's history is returned too."""
    from outlast.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from outlast.train.torch import TorchTrainer

    events = os.path.join(work, f"{name}.jsonl")
    try:
        TorchTrainer(loop, train_loop_config={"events": events, **config},
                     scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker={"CPU": 1}),
                     run_config=RunConfig(name=name, storage_path=os.path.join(work, "storage"),
                                          failure_config=FailureConfig(max_failures=max_failures))).fit()
    except TrainingFailedError as e:
        print(f"{name} failed: {e}", flush=True, file=__import__("sys").stderr)
    with open(os.path.join(work, "storage", name, "run_state.json")) as f:
        return read_events(events), json.load(f)


def failures(state: dict) -> list[dict]:
    return [f for a in state["attempts"] for f in a.get("failures", [])]


def first(events: list[dict], ev: str, **match) -> dict:
    return next((e for e in events if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())), {})


class Checks:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def __call__(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.problems.append(problem)
        return ok


def _fork_server(cluster, node_id: str, settle_s: float = 15.0) -> dict:
    """What the node says of its fork server and GPUs, once it has reaped the last run's workers
    (fit() returns on their last word, a moment before)."""
    deadline = time.monotonic() + settle_s
    while any((st := status(cluster, node_id)).gpus.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        with open(f"/proc/{st.fork_server_pid}/maps") as f:
            libcuda = "libcuda.so" in f.read()
    except OSError:
        libcuda = None
    return {"pid": st.fork_server_pid, "cuda_initialized": st.fork_server_cuda, "libcuda_mapped": libcuda,
            "gpus_held": {i: w for i, w in st.gpus.items() if w}}


def case_ddp(work: str, workers: int = 1) -> tuple[dict, list[str]]:
    check = Checks()
    with nodes(work, gpus=workers) as cluster:
        node = cluster.node_ids[-1]
        before = _fork_server(cluster, node)
        events, state = fit(work, gpu_loops.ddp_loop, "ddp", workers=workers)
        after = _fork_server(cluster, node)
    done = [e for e in events if e["ev"] == "done"]
    check(state["status"] == "finished" and len(done) == workers, f"the run ended {state['status']} with "
          f"{len(done)} of {workers} ranks done")
    for e in done:
        check(e["device"] == f"cuda:{e['rank']}", f"rank {e['rank']}: get_device() is {e['device']}")
        check(e["backend"] == "nccl", f"rank {e['rank']}: the backend is {e['backend']}")
        check(e["param_device"] == e["device"], f"rank {e['rank']}: parameters on {e['param_device']}")
        check(not e["bad_fork"], f"rank {e['rank']}: torch says its fork server had initialized CUDA")
        check(e["last_loss"] < e["first_loss"], f"rank {e['rank']}: the loss did not fall")
        check(e["all_reduce"] == workers, f"rank {e['rank']}: all_reduce gave {e['all_reduce']}")
        check(e["own"] == str(e["rank"]) and len((e["visible"] or "").split(",")) == workers,
              f"rank {e['rank']}: CUDA_VISIBLE_DEVICES={e['visible']}, OUTLAST_CUDA_DEVICES={e['own']}")
    for when, fs in (("before", before), ("after", after)):
        check(fs["cuda_initialized"] == "", f"the fork server {when} the run: {fs['cuda_initialized']}")
    check(after["gpus_held"] == {}, f"GPUs still held after the run: {after['gpus_held']}")
    return {"fork_server": after, "ranks": done}, check.problems


def case_kill(work: str, workers: int = 1) -> tuple[dict, list[str]]:
    check = Checks()
    hog_gb = 20.0 if workers == 1 else 4.0
    with nodes(work, gpus=workers) as cluster:
        events, state = fit(work, gpu_loops.kill_loop, "kill", workers=workers, max_failures=1, hog_gb=hog_gb,
                            kill_rank=workers - 1)
        after = _fork_server(cluster, cluster.node_ids[-1])
    check(state["status"] == "finished", f"the run ended {state['status']}")
    check(len(state["attempts"]) == 2, f"{len(state['attempts'])} attempts, not 2")
    check(any(f.get("signal") == 9 for f in failures(state)), "no failure by SIGKILL recorded")
    s1, s2 = first(events, "start", attempt=1, rank=0), first(events, "start", attempt=2, rank=0)
    if check(bool(s1 and s2), "an attempt did not start"):
        check(s2["free"] >= s1["free"] - 2**30, f"attempt 2 found {s2['free'] / 2**30:.1f} GiB free, attempt 1 "
              f"{s1['free'] / 2**30:.1f} GiB: the killed rank's {hog_gb:g} GB were not given back")
    restored = first(events, "restored", attempt=2, rank=0)
    check(restored.get("step") == 9, f"attempt 2 restored step {restored.get('step')}, not 9")
    done = [e for e in events if e["ev"] == "done"]
    check(len(done) == workers and all(e["w"] == 20 for e in done), f"the ranks ended with {done}")
    kill, step = first(events, "kill"), first(events, "first_step", attempt=2, rank=0)
    figures = {"hog_gb": hog_gb, "free_gib": [round(s.get("free", 0) / 2**30, 1) for s in (s1, s2)],
               "kill_to_training_again_s": round(step["t"] - kill["t"], 2) if kill and step else None,
               "fork_server": after}
    return figures, check.problems


def case_oom(work: str) -> tuple[dict, list[str]]:
    check = Checks()
    with nodes(work):
        events, state = fit(work, gpu_loops.oom_loop, "oom", max_failures=1)
    died = failures(state)
    named = [f for f in died if "OutOfMemoryError" in (f.get("exc_type") or "")]
    check(bool(named), f"no failure names OutOfMemoryError: {[f.get('exc_type') for f in died]}")
    check(len(state["attempts"]) == 2 and state["status"] == "finished",
          f"{len(state['attempts'])} attempts, status {state['status']}: no restart to a finish")
    check(bool(first(events, "done", attempt=2)), "attempt 2 did not train")
    return {"failure": (named or died or [{}])[0].get("message", "")[:300]}, check.problems


def case_save(work: str) -> tuple[dict, list[str]]:
    import torch

    check = Checks()
    gb = 4.0
    with nodes(work):
        events, state = fit(work, gpu_loops.save_loop, "save", max_failures=1, gb=gb)
    saved, restored = first(events, "saved"), first(events, "restored", attempt=2)
    if not check(bool(saved and restored), f"events: {[e['ev'] for e in events]}"):
        return {}, check.problems
    check(restored["digest"] == saved["sync_digest"], "the SYNC checkpoint restored on the GPU differs")
    check(restored["device"].startswith("cuda"), f"restored onto {restored['device']}")
    by_kind = {c["metrics"].get("kind"): c for c in state["checkpoints"]}
    if check("async" in by_kind, f"no committed save_async checkpoint: {list(by_kind)}"):
        path = os.path.join(work, "storage", "save", by_kind["async"]["checkpoint_dir"], "state.pt")
        on_cpu = torch.load(path, map_location="cpu")  # here in the driver, which keeps off the GPU
        check(gpu_loops.digest(on_cpu) == saved["async_digest"], "the save_async checkpoint differs from the "
              "state when save_async was called")
    return {"gb": saved["bytes"] / 1e9, "save_async_blocked_s": round(saved["async_blocked_s"], 3),
            "sync_report_blocked_s": round(saved["sync_blocked_s"], 3),
            "save_async_copy_gb_per_s": round(saved["bytes"] / 1e9 / saved["async_blocked_s"], 2)}, check.problems


def case_fsdp(work: str, workers: int = 1) -> tuple[dict, list[str]]:
    check = Checks()
    with nodes(work, gpus=workers):
        events, state = fit(work, gpu_loops.fsdp_loop, "fsdp", workers=workers, max_failures=1)
    saved, restored = first(events, "saved", attempt=1, rank=0), first(events, "restored", attempt=2, rank=0)
    check(state["status"] == "finished" and len(state["attempts"]) == 2,
          f"status {state['status']}, {len(state['attempts'])} attempts")
    check(restored.get("step") == 5, f"restored step {restored.get('step')}, not 5")
    check(bool(saved) and restored.get("digest") == saved.get("digest"), "the restored FSDP2 state differs")
    return {"checkpoints": len(state["checkpoints"])}, check.problems


def case_drain(work: str) -> tuple[dict, list[str]]:
    check = Checks()
    deadline_s, gb = 60, 2.0
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    events_path = os.path.join(work, "drain.jsonl")
    drained: dict = {}
    with nodes(work, count=2) as cluster:
        def drain():
            t_end = time.monotonic() + 120
            while time.monotonic() < t_end and not any(e["ev"] == "step" and e["step"] >= 5
                                                       for e in read_events(events_path)):
                time.sleep(0.01)
            node = next((e["node"] for e in read_events(events_path) if e["ev"] == "step"), None)
            if node is not None:
                cluster.drain_node(node, deadline_s=deadline_s)
                drained.update(node=node, t=time.time())

        threading.Thread(target=drain, daemon=True).start()
        events, state = fit(work, gpu_loops.drain_loop, "drain", gb=gb)
    notice, saved = first(events, "notice"), first(events, "saved")
    again = first(events, "restarted_step")
    if not check(bool(drained and notice and again), f"drained {drained}, events {[e['ev'] for e in events][-5:]}"):
        return {}, check.problems
    jit = [c for c in state["checkpoints"] if c["metrics"].get("preempted")]
    committed_s = jit[0]["committed_at"] - drained["t"] if jit else None
    check(committed_s is not None and committed_s < deadline_s, f"the just-in-time checkpoint committed at "
          f"{committed_s} s of a {deadline_s} s deadline")
    check(again["node"] != drained["node"], "the run did not move off the drained node")
    check(again.get("digest") == notice.get("digest"), "the CUDA state restored differs from the one saved")
    t0 = drained["t"]
    return {"gb": gb, "deadline_s": deadline_s, "notice_s": round(notice["t"] - t0, 2),
            "saved_s": round(saved["t"] - t0, 2), "committed_s": round(committed_s, 2),
            "first_step_elsewhere_s": round(again["t"] - t0, 2)}, check.problems


def case_timings(work: str) -> tuple[dict, list[str]]:
    check = Checks()
    figures: dict = {}
    with nodes(work):
        for device, use_gpu in (("gpu", True), ("cpu", False)):
            starts, restarts = [], []
            for i in range(3):
                t = time.time()
                events, state = fit(work, gpu_loops.timing_loop, f"t-{device}-{i}", max_failures=1, use_gpu=use_gpu,
                                    kill=True)
                a1, kill, a2 = first(events, "first_step", attempt=1), first(events, "kill"), \
                    first(events, "first_step", attempt=2)
                if not check(bool(a1 and kill and a2) and state["status"] == "finished",
                             f"{device} run {i}: {state['status']}, events {[e['ev'] for e in events]}"):
                    continue
                check(a1["device"].startswith("cuda") == use_gpu, f"{device} run {i} trained on {a1['device']}")
                starts.append(a1["t"] - t)
                restarts.append(a2["t"] - kill["t"])
            if starts:
                figures[device] = {"fit_to_first_step_s": _median(starts),
                                   "sigkill_to_training_again_s": _median(restarts), "runs": len(starts)}
    if "gpu" in figures and "cpu" in figures:
        figures["gpu_over_cpu"] = {k: round(figures["gpu"][k]["median"] / figures["cpu"][k]["median"], 2)
                                   for k in ("fit_to_first_step_s", "sigkill_to_training_again_s")}
    return figures, check.problems


def _median(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


CASES = [
    Case("nccl_ddp_one_rank", case_ddp, 1, 90),
    Case("sigkill_mid_step_frees_the_gpu", case_kill, 1, 90),
    Case("cuda_oom_is_a_named_failure", case_oom, 1, 60),
    Case("save_async_and_sync_of_4gb_cuda", case_save, 1, 150),
    Case("fsdp2_dcp_save_kill_restore", case_fsdp, 1, 90),
    Case("drain_jit_checkpoint_of_cuda_state", case_drain, 1, 120),
    Case("startup_and_restart_gpu_and_cpu", case_timings, 1, 150),
    # Two ranks, each on a GPU of its own: NCCL refuses two ranks on one device.
    Case("nccl_ddp_two_ranks", lambda w: case_ddp(w, workers=2), 2, 90),
    Case("sigkill_one_of_two_nccl_ranks", lambda w: case_kill(w, workers=2), 2, 90),
    Case("fsdp2_dcp_two_ranks", lambda w: case_fsdp(w, workers=2), 2, 90),
]
