"""Checkpoint benchmark: moving checkpoint bytes, outlast against the plain floor, Ray 2.60
and torch.distributed.checkpoint, on the same trees in the same run.

    python3 -m bench.checkpoint [--repeat 5] [--parts local,s3] [--trees one,many,eight]
                                [--methods M,...] [--big] [--out FILE]

Trees of incompressible bytes: "one" (one file), "many" (4 MB files) and "eight" (8
files; locally only), 0.5 GB on a local file system, 128 MB on S3 (a moto server on loopback, in-process Python: far slower
than a real store, so the ratios matter, not the MB/s); --big adds a 4 GB one-file tree
locally. Each measurement is a fresh process (bench/lib/checkpoint_probe.py); the methods
are interleaved run by run and the load average is kept with every run.

Figures per tree and method (median, min, max over --repeat): save_s (to the files being
in storage; outlast: before the manifest, a few ms), blocked_s (what a training loop waits
for: all of save_s, except async_save / save_async, which return after staging a copy in
memory; outlast_report: a SYNC report() inside a rank, to its commit), save_MBps, restore_s (outlast: every file checked against the manifest; on a file
system the checkpoint is read in place). Ratios: outlast / ray and outlast / floor for
throughput (> 1: outlast faster), ray / outlast for blocked time, and the parallel copies'
seconds over a SYNC report's (`report_vs.*`, >= 1: the report is at least as fast), and the report's
seconds over each method's run by run (`report_over_paired`: each pair from one round, <= 1: as fast).
One JSON document on stdout (and --out); exits 1 if any measurement failed.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench.lib import harness, venvs
from bench.lib.checkpoint_trees import MB, make_tree, probe, versions
from bench.lib.venvs import OUTLAST_PY

venvs.in_project_venv(__spec__.name, "psutil")
LOCAL_SAVE = ["copy", "copy_parallel", "copy_parallel_fsync", "outlast", "outlast_report", "outlast_move", "ray",
              "ray_report", "dcp", "dcp_async", "save_async", "torchsave+outlast", "torchsave+ray"]
S3_SAVE = ["fsspec", "outlast", "ray"]
# The same restore as another row, or a floor for the save alone.
NO_RESTORE = {"dcp_async", "outlast_move", "outlast_report", "ray_report", "torchsave+outlast", "torchsave+ray",
              "copy_parallel", "copy_parallel_fsync"}
FLOOR = {"local": "copy", "s3": "fsspec"}


def log(msg):
    print(f"[checkpoint {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def remove(dest, env):
    if "://" not in dest:
        shutil.rmtree(dest, ignore_errors=True)
        return
    subprocess.run([OUTLAST_PY, "-c", "import fsspec, sys; fs, p = fsspec.core.url_to_fs(sys.argv[1]); "
                    "fs.rm(p, recursive=True) if fs.exists(p) else None", dest], env=env, timeout=120, check=False)


def run_case(where, tree, src, methods, base, args, workdir, env, errors):
    """({method: summary of its runs}, {m: summary of the report's seconds over m's, run by run}: each pair from
    one round of the interleaving, which the machine's load moves alike)."""
    runs = {m: [] for m in methods}
    seconds = {m: {} for m in methods}  # method -> round -> save_s
    for i, method in harness.interleaved(methods, args.repeat):
        tag = f"{tree}-{method.replace('+', '_')}-{i}"
        dest, into = f"{base}/{tag}", os.path.join(workdir, "restored", tag)
        os.sync()  # the previous run's writeback must not land in this one's time
        load = harness.load()
        saved = probe(method, "save", src, dest, into, env, workdir, errors)
        if saved is None:
            continue
        fig = {"save_s": saved["s"], "blocked_s": saved["blocked_s"], "save_MBps": saved["bytes"] / saved["s"] / 1e6,
               "load1": load[0], **{f"phase.{k}": v for k, v in saved.get("phases", {}).items()}}
        if method not in NO_RESTORE:
            restored = probe(method, "restore", src, dest, into, env, workdir, errors)
            if restored is not None:
                fig.update(restore_s=restored["s"], restore_MBps=restored["bytes"] / restored["s"] / 1e6)
        runs[method].append(fig)
        seconds[method][i] = saved["s"]
        log(f"{where} {tag}: " + json.dumps({k: round(v, 3) for k, v in fig.items()}))
        remove(dest, env)
        shutil.rmtree(into, ignore_errors=True)
    report = seconds.get("outlast_report", {})
    paired = {m: harness.summary([report[i] / s[i] for i in sorted(report.keys() & s.keys()) if s[i] > 0])
              for m, s in seconds.items() if m != "outlast_report" and report.keys() & s.keys()}
    return {m: harness.summarize_runs(r) for m, r in runs.items()}, paired


def from_log(path, where):
    """The figures of an earlier run, rebuilt from its per-run stderr lines (the run was cut
    short before its JSON): {tree: {method: [per-run figures]}}."""
    runs = {}
    with open(path) as f:
        for line in f:
            head, sep, body = line.partition(": {")
            if not sep or f"] {where} " not in head:
                continue
            tag = head.rsplit(" ", 1)[1]
            tree, rest = tag.split("-", 1)
            method = rest.rsplit("-", 1)[0].replace("torchsave_", "torchsave+")
            runs.setdefault(tree, {}).setdefault(method, []).append(json.loads("{" + body))
    return runs


def ratios(where, by_method):
    out = {}
    floor, ours, ray = by_method.get(FLOOR[where], {}), by_method.get("outlast", {}), by_method.get("ray", {})
    for key in ("save_MBps", "restore_MBps"):
        out[f"outlast_over_ray.{key}"] = harness.ratio(ours.get(key), ray.get(key))
        out[f"outlast_over_floor.{key}"] = harness.ratio(ours.get(key), floor.get(key))
        out[f"ray_over_floor.{key}"] = harness.ratio(ray.get(key), floor.get(key))
    if where == "local":
        report = by_method.get("outlast_report", {}).get("save_s")
        for m in ("copy_parallel", "copy_parallel_fsync", "copy", "ray", "ray_report"):
            out[f"report_vs.{m}.save_s"] = harness.ratio(by_method.get(m, {}).get("save_s"), report)
        move = by_method.get("outlast_move", {})
        out["outlast_move_over_ray.save_MBps"] = harness.ratio(move.get("save_MBps"), ray.get("save_MBps"))
        ray_loop = by_method.get("torchsave+ray", {}).get("blocked_s")
        for m in ("save_async", "dcp_async", "dcp", "torchsave+outlast"):
            out[f"loop_blocked.ray_pattern_over.{m}"] = harness.ratio(ray_loop, by_method.get(m, {}).get("blocked_s"))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--parts", default="local,s3")
    p.add_argument("--local-mb", type=int, default=512)
    p.add_argument("--s3-mb", type=int, default=128)
    p.add_argument("--trees", default="one,many,eight", help="of one, many, eight (eight: locally only)")
    p.add_argument("--methods", help="only these methods (comma-separated), of " + ",".join(LOCAL_SAVE))
    p.add_argument("--big", action="store_true", help="also a 4 GB one-file tree, locally")
    p.add_argument("--out")
    p.add_argument("--from-log", help="rebuild the figures of --parts (one) from an earlier run's stderr")
    args = p.parse_args()
    if args.from_log:
        return rebuild(args)
    parts = set(args.parts.split(","))
    venvs.ensure_ray_venv()
    workdir = tempfile.mkdtemp(prefix="outlast-ckpt-bench-", dir=os.environ.get("BENCH_DIR"))
    harness.private_state_dirs(workdir)  # the runs of outlast_report and ray_report join no one else's node
    log(f"trees and logs in {workdir}")
    started, load_before, errors, figures = time.time(), harness.load(), [], {}
    env = venvs.with_root(dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    trees, only = set(args.trees.split(",")), set(args.methods.split(",")) if args.methods else None
    cases = []
    if "local" in parts:
        cases += [("local", "one", args.local_mb, args.local_mb), ("local", "many", args.local_mb, 4),
                  ("local", "eight", args.local_mb, max(args.local_mb // 8, 1))]
        if args.big:
            cases.append(("local", "one_4GB", 4096, 4096))
    if "s3" in parts:
        cases += [("s3", "one", args.s3_mb, args.s3_mb), ("s3", "many", args.s3_mb, 4)]
    cases = [c for c in cases if c[1] in trees or c[1] == "one_4GB"]
    moto = None
    try:
        for where, tree, total, file_mb in cases:
            src = os.path.join(workdir, f"src-{where}-{tree}")
            make_tree(src, total, file_mb)
            if where == "s3" and moto is None:
                moto, aws = harness.start_s3(workdir, OUTLAST_PY)
                env.update(aws)
            base = os.path.join(workdir, "storage", "run") if where == "local" else "s3://bench/run"
            methods = [m for m in (LOCAL_SAVE if where == "local" else S3_SAVE) if only is None or m in only]
            by_method, paired = run_case(where, tree, src, methods, base, args, workdir, env, errors)
            figures[f"{where}.{tree}"] = {"MB": total * MB / 1e6, "files": max(total // file_mb, 1),
                                          "methods": by_method, "ratios": ratios(where, by_method),
                                          "report_over_paired": paired}
            shutil.rmtree(src, ignore_errors=True)
    finally:
        if moto is not None:
            moto.kill()
            moto.wait()
    doc = {"benchmark": "checkpoint", "date": harness.stamp(), "figures": figures,
           "machine": harness.machine(versions()),
           "load": {"before": load_before, "after": harness.load(),
                    "note": "a shared 2-core machine loaded by other test suites; load1 is kept with every run"},
           "settings": {"repeat": args.repeat, "local_mb": args.local_mb, "s3_mb": args.s3_mb, "big": args.big,
                        "trees": sorted(trees), "methods": sorted(only) if only else "all",
                        "restore": "right after each save (page cache warm for every method alike)"},
           "wall_s": round(time.time() - started, 1), "errors": errors, "logs": workdir}
    harness.publish(doc, args.out)
    shutil.rmtree(os.path.join(workdir, "storage"), ignore_errors=True)
    return 1 if errors else 0


def rebuild(args):
    where = args.parts
    figures = {}
    for tree, by_method in from_log(args.from_log, where).items():
        summaries = {m: harness.summarize_runs(r) for m, r in by_method.items()}
        total = args.local_mb if where == "local" else args.s3_mb
        figures[f"{where}.{tree}"] = {"MB": total * MB / 1e6, "files": {"one": 1, "eight": 8}.get(tree, total // 4),
                                      "methods": summaries, "ratios": ratios(where, summaries)}
    loads = [r["load1"] for t in from_log(args.from_log, where).values() for rs in t.values() for r in rs]
    doc = {"benchmark": "checkpoint", "date": harness.stamp(), "figures": figures,
           "machine": harness.machine(versions()),
           "load": {"during": harness.summary(loads),
                    "note": "a shared 2-core machine loaded by other test suites; load1 is kept with every run"},
           "settings": {"repeat": args.repeat, "parts": where, "local_mb": args.local_mb, "s3_mb": args.s3_mb,
                        "restore": "right after each save (page cache warm for every method alike)"},
           "source": f"rebuilt with --from-log from the per-run lines of an earlier run ({args.from_log})",
           "errors": []}
    harness.publish(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
