"""Memory tier benchmark: a restore from a peer's RAM beside restores from local disk and from S3, outlast
against Ray 2.60 and the plain floor in the same run, and what the tier costs a node.

    python3 -m bench.memory_tier [--repeat 3] [--sizes-mb 1024,4096] [--s3-sizes-mb 1024] [--out FILE]

Trees of one file of incompressible bytes. Three real agents of one cluster (LocalCluster, CURVE with the
cluster key, tiers in /dev/shm): the checkpoint is held on node-1 with its replica on node-0, as a report
leaves it; a restore "from a peer's memory" is what a rank placed on node-2, which holds nothing, waits
for: node-2's agent pulls the replica from node-0 (TierPull, chunks over the cluster's transport, checked
on arrival) and the rank puts the checkpoint together from node-2's tier, every file checked against the
manifest. "local memory" is a rank on node-1 itself. Disk and S3 restores are bench/lib/checkpoint_probe.py's
(outlast: materialize, checked; ray: Ray Train V2's pyarrow copy; floor: a plain copy / fsspec get), on
the same trees, each in a fresh process, interleaved run by run, with the load average kept.

Memory cost: the bytes each node's tier holds (a primary copy on the rank's node, a replica on its peer:
twice the checkpoint across the cluster) and the agents' resident memory before and after (the transfers
go in 8 MiB chunks, at most 4 in flight).
One JSON document on stdout (and --out); exits 1 if any measurement failed.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from bench.lib import venvs
from bench.lib.venvs import OUTLAST_PY

venvs.in_project_venv(__spec__.name, "psutil", "zmq")

import psutil  # noqa: E402
import zmq  # noqa: E402

from bench.lib import harness  # noqa: E402
from bench.lib.checkpoint_trees import MB, make_tree, probe, run_probe, versions  # noqa: E402
from outlast.agent.tier_client import ask  # noqa: E402
from outlast.protocol import messages as m  # noqa: E402
from outlast.protocol.auth import ClusterKey  # noqa: E402
from outlast.storage import open_storage  # noqa: E402
from outlast.storage.run_store import RunStore  # noqa: E402
from outlast.testing import LocalCluster  # noqa: E402


def log(msg):
    print(f"[memory-tier {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss(cluster):
    out = {}
    for node_id, node in cluster.nodes.items():
        try:
            out[node_id] = psutil.Process(node.proc.pid).memory_info().rss
        except psutil.Error:
            out[node_id] = None
    return out


def tier_of(cluster, node_id):
    return next(n.tier_address for n in cluster.node_table() if n.node_id == node_id)


def restore_probe(dest, node, cluster, workdir, env, errors):
    cache = os.path.join(workdir, "cache-tier")
    try:
        return run_probe(venvs.module(OUTLAST_PY, "bench.lib.tier_probe", "--dest", dest, "--node", node,
                                      "--tier-dir", str(cluster.tier_dir), "--cache", cache),
                         env, f"tier restore of {dest} on {node}", errors)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def memory_case(size_mb, src, args, workdir, env, errors, cluster, ctx, key):
    """Hold the tree as rank 0's files of one checkpoint, then restore it from local and from peer memory."""
    dest = os.path.join(workdir, "storage", "run", f"checkpoint_000_{size_mb:06d}")
    saved = probe("outlast", "save", src, dest, os.path.join(workdir, "unused"), env, workdir, errors)
    if saved is None:
        return None
    storage = open_storage(os.path.join(workdir, "storage"))
    run_key, name = storage.uri("run"), os.path.basename(dest)
    manifest = RunStore(storage, "run").read_manifest(name)
    before = rss(cluster)
    hold = m.TierHold(run=run_key, checkpoint_dir=name, rank=0, seq=1, files=manifest.files, source_dir=src,
                      peer_address=tier_of(cluster, "node-0"))
    load = harness.load()
    stored = ask(ctx, key, tier_of(cluster, "node-1"), hold, timeout_s=600)
    if not stored.ok or not stored.replica_node:
        errors.append(f"hold of {size_mb} MB: {stored.reason or stored.replica_reason}")
        return None
    held = {"hold_s": stored.seconds, "replica_s": stored.replica_seconds,
            "replica_MBps": stored.nbytes / stored.replica_seconds / 1e6, "load1": load[0]}
    log(f"memory {size_mb}MB hold: " + json.dumps({k: round(v, 3) for k, v in held.items()}))
    runs = {"outlast_peer_memory": [], "outlast_local_memory": [], "outlast_disk": [], "ray_disk": [],
            "copy_disk": []}
    for i, method in harness.interleaved(list(runs), args.repeat):
        load = harness.load()
        if method == "outlast_peer_memory":
            t0 = time.perf_counter()
            pulled = ask(ctx, key, tier_of(cluster, "node-2"),
                         m.TierPull(run=run_key, checkpoint_dir=name, rank=0, from_address=tier_of(cluster, "node-0")),
                         timeout_s=600)
            pull_s = time.perf_counter() - t0
            got = restore_probe(dest, "node-2", cluster, workdir, env, errors) if pulled.ok else None
            if not pulled.ok:
                errors.append(f"pull of {size_mb} MB: {pulled.reason}")
            if got is not None and got["source"] == "local_memory":
                fig = {"restore_s": pull_s + got["s"], "pull_s": pull_s, "assemble_s": got["s"]}
            else:
                fig = None
                errors.append(f"peer restore of {size_mb} MB came from {got and got['source']}")
            ask(ctx, key, tier_of(cluster, "node-2"), m.TierFree(run=run_key), timeout_s=60)
        elif method == "outlast_local_memory":
            got = restore_probe(dest, "node-1", cluster, workdir, env, errors)
            fig = {"restore_s": got["s"]} if got is not None and got["source"] == "local_memory" else None
        else:
            kind = {"outlast_disk": "outlast", "ray_disk": "ray", "copy_disk": "copy"}[method]
            into = os.path.join(workdir, "restored", f"{method}-{i}")
            got = probe(kind, "restore", src, dest, into, env, workdir, errors)
            shutil.rmtree(into, ignore_errors=True)
            fig = {"restore_s": got["s"]} if got is not None else None
        if fig is not None:
            fig.update(restore_MBps=size_mb * MB / fig["restore_s"] / 1e6, load1=load[0])
            runs[method].append(fig)
            log(f"memory {size_mb}MB {method}-{i}: " + json.dumps({k: round(v, 3) for k, v in fig.items()}))
    listed = {n: ask(ctx, key, tier_of(cluster, n), m.TierList(), timeout_s=60) for n in cluster.nodes}
    cost = {"tier_bytes": {n: h.used_bytes for n, h in listed.items()},
            "agent_rss_before": before, "agent_rss_after": rss(cluster)}
    for n in cluster.nodes:
        ask(ctx, key, tier_of(cluster, n), m.TierFree(run=run_key), timeout_s=60)
    shutil.rmtree(dest, ignore_errors=True)
    by = {k: harness.summarize_runs(v) for k, v in runs.items()}
    peer = by["outlast_peer_memory"].get("restore_MBps")
    ratios = {"outlast_peer_memory_over_ray_disk.restore_MBps": harness.ratio(peer, by["ray_disk"].get("restore_MBps")),
              "outlast_peer_memory_over_outlast_disk.restore_MBps":
                  harness.ratio(peer, by["outlast_disk"].get("restore_MBps")),
              "outlast_disk_over_ray_disk.restore_MBps":
                  harness.ratio(by["outlast_disk"].get("restore_MBps"), by["ray_disk"].get("restore_MBps")),
              "outlast_local_memory_over_ray_disk.restore_MBps":
                  harness.ratio(by["outlast_local_memory"].get("restore_MBps"), by["ray_disk"].get("restore_MBps"))}
    return {"MB": size_mb * MB / 1e6, "hold": held, "methods": by, "ratios": ratios, "memory_cost": cost}


def s3_case(size_mb, src, args, workdir, env, errors):
    runs = {"outlast_s3": [], "ray_s3": [], "fsspec_s3": []}
    dests = {}
    for method, kind in (("outlast_s3", "outlast"), ("ray_s3", "ray"), ("fsspec_s3", "fsspec")):
        dests[method] = f"s3://bench/run-{method}/checkpoint_000_{size_mb:06d}"
        if probe(kind, "save", src, dests[method], os.path.join(workdir, "unused"), env, workdir, errors) is None:
            return None
    for i, method in harness.interleaved(list(runs), args.repeat):
        kind = method.split("_")[0]
        into = os.path.join(workdir, "restored", f"{method}-{i}")
        load = harness.load()
        got = probe(kind, "restore", src, dests[method], into, env, workdir, errors)
        shutil.rmtree(into, ignore_errors=True)
        if got is not None:
            fig = {"restore_s": got["s"], "restore_MBps": size_mb * MB / got["s"] / 1e6, "load1": load[0]}
            runs[method].append(fig)
            log(f"s3 {size_mb}MB {method}-{i}: " + json.dumps({k: round(v, 3) for k, v in fig.items()}))
    by = {k: harness.summarize_runs(v) for k, v in runs.items()}
    return {"MB": size_mb * MB / 1e6, "methods": by,
            "ratios": {"outlast_over_ray.restore_MBps": harness.ratio(by["outlast_s3"].get("restore_MBps"),
                                                                      by["ray_s3"].get("restore_MBps")),
                       "outlast_over_floor.restore_MBps": harness.ratio(by["outlast_s3"].get("restore_MBps"),
                                                                        by["fsspec_s3"].get("restore_MBps"))}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--sizes-mb", default="1024,4096")
    p.add_argument("--s3-sizes-mb", default="1024")
    p.add_argument("--out")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="outlast-tier-bench-", dir=os.environ.get("BENCH_DIR"))
    log(f"trees and logs in {workdir}")
    started, load_before, errors, figures = time.time(), harness.load(), [], {}
    env = venvs.with_root(dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    s3_sizes = [int(s) for s in args.s3_sizes_mb.split(",") if s]
    moto = None
    budget = f"{max(sizes) * 2 + 64}MiB"
    with LocalCluster(3, preload=[], workdir=os.path.join(workdir, "cluster")) as cluster:
        for node_id in list(cluster.nodes):  # each node's budget fits the largest tree, and a replica
            cluster.kill_node(node_id)
            cluster.nodes[node_id].args.extend(["--checkpoint-memory", budget])
            cluster.restart_node(node_id)
        ctx = zmq.Context()
        key = ClusterKey.load(cluster.key_file)
        try:
            for size in sorted(set(sizes) | set(s3_sizes)):
                src = os.path.join(workdir, f"src-{size}")
                make_tree(src, size, size)
                if size in sizes:
                    figures[f"memory_and_disk.{size}MB"] = memory_case(size, src, args, workdir, env, errors,
                                                                       cluster, ctx, key)
                if size in s3_sizes:
                    if moto is None:
                        moto, aws = harness.start_s3(workdir, OUTLAST_PY)
                        env.update(aws)
                    figures[f"s3.{size}MB"] = s3_case(size, src, args, workdir, env, errors)
                shutil.rmtree(src, ignore_errors=True)
        finally:
            ctx.destroy(linger=0)
            if moto is not None:
                moto.kill()
                moto.wait()
    for size in s3_sizes:
        mem, s3 = figures.get(f"memory_and_disk.{size}MB"), figures.get(f"s3.{size}MB")
        if mem and s3:
            figures[f"s3.{size}MB"]["ratios"]["outlast_peer_memory_over_ray_s3.restore_MBps"] = harness.ratio(
                mem["methods"]["outlast_peer_memory"].get("restore_MBps"), s3["methods"]["ray_s3"].get("restore_MBps"))
    doc = {"benchmark": "memory_tier", "date": harness.stamp(), "figures": figures,
           "machine": harness.machine(versions()),
           "load": {"before": load_before, "after": harness.load(),
                    "note": "a shared 2-core machine loaded by other engineers' test suites; load1 is kept with "
                            "every run"},
           "settings": {"repeat": args.repeat, "sizes_mb": sizes, "s3_sizes_mb": s3_sizes,
                        "checkpoint_memory": budget,
                        "scaled": "S3 (moto, in-process Python on loopback) at the smaller size only: a 4 GB "
                                  "restore from it takes minutes per run on this 2-core machine",
                        "restore": "right after the save and the hold (page cache warm for every method alike)"},
           "wall_s": round(time.time() - started, 1), "errors": errors, "logs": workdir}
    harness.publish(doc, args.out)
    shutil.rmtree(os.path.join(workdir, "storage"), ignore_errors=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
