"""A drain with a short deadline of a run whose checkpoint is large: what each framework commits in time.

    .venv/bin/python -m bench.drain_deadline [--gb 2] [--deadline-s 10] [--repeats 2] [--only outlast|ray]
        [--out bench/results/drain-deadline-2gb.json]

The same scenario on outlast and on Ray Train V2 2.60 (bench/.ray-venv), interleaved: a head that takes
no workers and two 1-CPU worker nodes on loopback (outlast: `LocalCluster`, each node with
`--checkpoint-memory 6GiB`; Ray: `ray.cluster_utils.Cluster`), storage on S3 (one moto server for both,
as a cloud's object store is: far slower than the nodes' memory and network). One worker whose state is
one float32 tensor of --gb GB (random: nothing compresses). Its loop, the same on both:
- step 0 saves the state (`torch.save` into a temporary directory, `report(checkpoint=...)`), durable
  before training goes on: the checkpoint a restore falls back to;
- then steps of 20 ms that ask `get_preemption_info()`; at the first notice, the same save again: the
  just-in-time checkpoint, then the loop ends.
At step 25 after the first checkpoint, the workers' node is drained with each framework's CLI (reason
preemption, --deadline-s) and killed at the deadline, as a cloud reclaims a machine. The restarted worker,
on the other node, reads the step its checkpoint holds and stops.

Figures per run (seconds from when the drain command returned): the notice on the rank, the save done,
the just-in-time checkpoint committed (outlast: its `committed_at` in the run's history, in memory on the
drained node and its peer, docs/guide/memory-tier.md; Ray: its `report()` returned) and whether that came
before the deadline, the step restored and the steps lost (the last step trained on the drained node minus
the step restored), the first step on the other node. outlast's checkpoint is durable later, uploaded from
the peer's memory: `durable_s` is when `fit()` returned, which waits for that upload. Workers' temporary
directories are in /dev/shm on both, so the save is memory's time. moto keeps every object in its memory
(it reached 8.8 GB in a 2 GB run here, and the kernel killed it).
One JSON document on stdout (and --out), progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench.lib import harness
from bench.lib.events import emit, read_events
from bench.lib.clusters import head_and_workers
from bench.lib.harness import wait_for
from bench.lib.venvs import OUTLAST_PY, RAY_PY, ROOT, module

STEP_S = 0.02
DRAIN_AFTER = 25  # steps after the first checkpoint


def log(msg: str) -> None:
    print(f"[drain-deadline {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loop(train, checkpoint_cls, node: str, config: dict) -> None:
    """The training function of both frameworks (`train` is outlast.train or ray.train)."""
    import torch

    events = config["events"]
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d, open(os.path.join(d, "step.json")) as f:
            step = json.load(f)["step"]
        emit(events, ev="restored", step=step, node=node, t=time.time())
        return
    torch.manual_seed(0)
    state = {"w": torch.rand(int(config["gb"] * 1e9) // 4)}

    def save(step: int) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(state, os.path.join(tmp, "model.pt"))
            with open(os.path.join(tmp, "step.json"), "w") as f:
                json.dump({"step": step}, f)
            emit(events, ev="saved", step=step, t=time.time())
            train.report({"step": step}, checkpoint=checkpoint_cls.from_directory(tmp))
        emit(events, ev="committed", step=step, t=time.time())

    save(0)
    for step in range(1, 10**9):
        time.sleep(STEP_S)
        emit(events, ev="step", step=step, node=node, t=time.time())
        if train.get_preemption_info() is not None:
            emit(events, ev="notice", step=step, t=time.time())
            save(step)
            return


def figures(evs: list[dict], t_drain: float, deadline: float, node: str) -> dict:
    first = {}
    for e in evs:
        first.setdefault((e["ev"], e.get("step") if e["ev"] in ("saved", "committed") else None), e)
    notice = next((e for e in evs if e["ev"] == "notice"), None)
    restored = next((e for e in evs if e["ev"] == "restored"), None)
    last = max((e["step"] for e in evs if e["ev"] == "step" and e["node"] == node and e["t"] <= deadline), default=0)
    out = {"notice_s": notice["t"] - t_drain if notice else None, "last_step_on_drained_node": last}
    if notice:
        saved = first.get(("saved", notice["step"]))
        done = first.get(("committed", notice["step"]))
        out.update(jit_step=notice["step"], saved_s=saved["t"] - t_drain if saved else None,
                   committed_s=done["t"] - t_drain if done else None,
                   committed_before_deadline=bool(done and done["t"] <= deadline))
    if restored:
        out.update(restored_step=restored["step"], steps_lost=last - restored["step"],
                   first_step_elsewhere_s=restored["t"] - t_drain, restarted_on_other_node=restored["node"] != node)
    return out


# ---------------------------------------------------------------------------------------------- outlast


def outlast_loop(config: dict) -> None:
    from outlast import train

    loop(train, train.Checkpoint, os.environ.get("OUTLAST_NODE_ID", ""), config)


def outlast_run(args, s3_url: str, work: str) -> dict:
    from outlast.train import FailureConfig, RunConfig, ScalingConfig
    from outlast.train.torch import TorchTrainer

    events = os.path.join(work, "events.jsonl")
    storage = f"s3://bench/outlast-{os.path.basename(work)}"
    seen: dict = {}
    with head_and_workers(work, node_args=["--checkpoint-memory", "6GiB"]) as (cluster, _):
        def drain_then_kill():
            try:
                after = wait_for(lambda: next((e for e in read_events(events) if e["ev"] == "committed"), None),
                                 600, "the first checkpoint")
                wait_for(lambda: any(e["ev"] == "step" and e["step"] >= DRAIN_AFTER for e in read_events(events)),
                         120, f"step {DRAIN_AFTER}")
                node = next(e["node"] for e in read_events(events) if e["ev"] == "step")
                seen["first_commit_s"] = after["t"]
                seen["t_drain_cmd"] = time.time()
                cluster.drain_node(node, deadline_s=args.deadline_s)
                seen.update(node=node, t_drain=time.time())
                deadline = seen["t_drain_cmd"] + args.deadline_s
                time.sleep(max(0.0, deadline - time.time()))
                cluster.kill_node(node)
                seen["t_killed"] = time.time()
            except Exception as e:  # noqa: BLE001 - said in the figures
                seen["error"] = f"{type(e).__name__}: {e}"

        thread = threading.Thread(target=drain_then_kill, daemon=True)
        thread.start()
        trainer = TorchTrainer(
            outlast_loop, train_loop_config={"events": events, "gb": args.gb},
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="drain", storage_path=storage,
                                 failure_config=FailureConfig(max_failures=1)))
        result = trainer.fit()
        thread.join(timeout=60)
        seen["t_fit_returned"] = time.time()  # fit() returns once a drain's checkpoint is durable too
    import fsspec

    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3_url})
    history = json.loads(fs.cat(f"{storage[5:]}/drain/run_state.json"))
    jit_step = next((e["step"] for e in read_events(events) if e["ev"] == "notice"), None)
    seen["jit"] = next((c for c in history["checkpoints"] if c["metrics"].get("step") == jit_step), None)
    if "error" in seen:
        raise RuntimeError(seen["error"])
    out = figures(read_events(events), seen["t_drain"], seen["t_drain_cmd"] + args.deadline_s, seen["node"])
    out["fit_error"] = repr(result.error) if result.error else None
    jit = seen["jit"]
    if jit is not None:
        # The rank's report() does not return: its attempt is stopped once the checkpoint is committed.
        deadline = seen["t_drain_cmd"] + args.deadline_s
        out.update(committed_s=jit["committed_at"] - seen["t_drain"],
                   committed_before_deadline=jit["committed_at"] <= deadline,
                   committed_in_memory_on=jit["memory"],
                   in_memory_on_two_nodes_s=jit["memory_at"] - seen["t_drain"] if jit["memory_at"] else None,
                   durable_s=seen["t_fit_returned"] - seen["t_drain"] if jit["durable"] else None)
    return out


# ---------------------------------------------------------------------------------------------- Ray


def ray_loop(config: dict) -> None:
    import ray
    from ray import train

    loop(train, train.Checkpoint, ray.get_runtime_context().get_node_id(), config)


def ray_driver(address: str, events: str, storage: str, gb: float) -> int:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=address)
    trainer = TorchTrainer(
        ray_loop, train_loop_config={"events": events, "gb": gb}, torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False),
        run_config=RunConfig(name="drain", storage_path=storage,
                             failure_config=FailureConfig(max_failures=1, max_preemption_failures=-1)))
    result = trainer.fit()
    emit(events, ev="fit_end", t=time.time(), error=repr(result.error))
    return 0


def ray_run(args, s3_url: str, work: str) -> dict:
    from ray.cluster_utils import Cluster

    events = os.path.join(work, "events.jsonl")
    env = dict(os.environ, RAY_TRAIN_V2_ENABLED="1", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
               TMPDIR="/dev/shm")
    os.environ.update(RAY_TRAIN_V2_ENABLED="1", RAY_USAGE_STATS_ENABLED="0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    proc = None
    try:
        nodes = [cluster.add_node(num_cpus=1, object_store_memory=1 << 30) for _ in range(2)]
        cluster.wait_for_nodes()
        with open(os.path.join(work, "driver.log"), "w") as f:
            proc = subprocess.Popen(module(sys.executable, __spec__.name, "--_ray-driver", cluster.address, events,
                                           f"s3://bench/ray-{os.path.basename(work)}", str(args.gb)),
                                    env=env, stdout=f, stderr=subprocess.STDOUT, process_group=0, cwd=ROOT)
        wait_for(lambda: any(e["ev"] == "committed" for e in read_events(events)) or proc.poll() is not None,
                 600, "the first checkpoint")
        wait_for(lambda: any(e["ev"] == "step" and e["step"] >= DRAIN_AFTER for e in read_events(events))
                 or proc.poll() is not None, 120, f"step {DRAIN_AFTER}")
        if proc.poll() is not None:
            raise RuntimeError(f"Ray's driver exited early, see {work}/driver.log")
        node = next(e["node"] for e in read_events(events) if e["ev"] == "step")
        t_cmd = time.time()
        done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "drain-node", "--address",
                               cluster.address, "--node-id", node, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                               "--reason-message", "bench", "--deadline-remaining-seconds", str(args.deadline_s)],
                              env=env, capture_output=True, text=True, timeout=60)
        t_drain = time.time()
        if done.returncode != 0:
            raise RuntimeError(f"ray drain-node failed: {done.stderr[-500:]}")
        deadline = t_cmd + args.deadline_s
        time.sleep(max(0.0, deadline - time.time()))
        cluster.remove_node(next(n for n in nodes if n.node_id == node), allow_graceful=False)
        wait_for(lambda: any(e["ev"] in ("restored", "fit_end") for e in read_events(events))
                 or proc.poll() is not None, 900, "the restarted worker")
        return figures(read_events(events), t_drain, deadline, node)
    finally:
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        cluster.shutdown()


# ---------------------------------------------------------------------------------------------- both


def side(args) -> int:
    """One run of one framework, in this process (the right virtual environment): its figures on stdout."""
    work = tempfile.mkdtemp(prefix=f"drain-deadline-{args.side}-")
    try:
        run = outlast_run if args.side == "outlast" else ray_run
        print(json.dumps(run(args, os.environ["AWS_ENDPOINT_URL"], work)))
    finally:
        # The nodes' logs and the events stay (without the checkpoints' bytes): what a run that missed says.
        kept = shutil.copytree(work, tempfile.mkdtemp(prefix=f"drain-deadline-{args.side}-logs-", dir="/tmp"),
                               dirs_exist_ok=True, ignore=lambda d, names: [n for n in names if n.endswith((".pt", ".bin"))
                                                                           or n in ("tier", "storage")])
        log(f"{args.side}: logs and events in {kept}")
        shutil.rmtree(work, ignore_errors=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0)
    p.add_argument("--deadline-s", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", choices=["outlast", "ray"])
    p.add_argument("--side", choices=["outlast", "ray"], help=argparse.SUPPRESS)
    p.add_argument("--out")
    if len(sys.argv) > 1 and sys.argv[1] == "--_ray-driver":
        return ray_driver(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
    args = p.parse_args()
    if args.side:
        return side(args)
    sides = [s for s in ("outlast", "ray") if args.only in (None, s)]
    runs: dict[str, list] = {s: [] for s in sides}
    for i, name in harness.interleaved(sides, args.repeats):
        # A moto server of each run's own: it keeps every object in its memory.
        work = tempfile.mkdtemp(prefix="drain-deadline-")
        moto, aws = harness.start_s3(work, OUTLAST_PY)
        # The workers' temporary directories, in memory, go with the run: a worker killed at the deadline
        # leaves its just-in-time checkpoint's directory behind, as a reclaimed machine would not.
        tmp = tempfile.mkdtemp(prefix="drain-deadline-tmp-", dir="/dev/shm")
        env = dict(os.environ, **aws, TMPDIR=tmp)
        try:
            py = OUTLAST_PY if name == "outlast" else RAY_PY
            load = harness.load()
            log(f"{name} run {i + 1}")
            done = subprocess.run(module(py, __spec__.name, "--side", name, "--gb", str(args.gb), "--deadline-s",
                                         str(args.deadline_s)), env=env, stdout=subprocess.PIPE, text=True, timeout=1800,
                                  cwd=ROOT)
            fig = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() \
                else {"error": f"exit {done.returncode}"}
            fig["load1"] = load[0]
            runs[name].append(fig)
            log(f"{name}: {json.dumps(fig)}")
        finally:
            os.killpg(moto.pid, signal.SIGKILL)
            moto.wait()
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
    by = {name: harness.summarize_runs([{k: v for k, v in r.items() if isinstance(v, (int, float))
                                          and not isinstance(v, bool)} for r in rs]) for name, rs in runs.items()}
    doc = {"checkpoint_gb": args.gb, "deadline_s": args.deadline_s, "repeats": args.repeats,
           "machine": harness.machine({}), "summary": by, "runs": runs,
           "committed_before_deadline": {n: [r.get("committed_before_deadline") for r in rs] for n, rs in runs.items()},
           "steps_lost": {n: [r.get("steps_lost") for r in rs] for n, rs in runs.items()}}
    harness.publish(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
