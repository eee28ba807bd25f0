"""One timed checkpoint transfer, one way, in a fresh process.

    python -m bench.lib.checkpoint_probe --method M --op save|restore --src DIR --dest DIR_OR_S3_URL

save: the files of --src into --dest; restore: --dest back into a new local directory.
Methods: copy (shutil.copytree: the plain floor on a file system), copy_parallel (the
files copied by a pool of threads, as Ray's copy does, no checksum), copy_parallel_fsync
(the same, each file and its directory then fsynced: the floor of a copy that outlasts a
power loss, which outlast's commit promises), fsspec (a plain recursive put/get: the floor
on S3), outlast (upload_dir; restore = materialize, which checks every file against the
manifest), outlast_report (a SYNC `report()` of one rank of a run on an embedded node
with its memory tier, timed inside the worker 20 s into the run: the upload, the manifest
and what the commit waits for; with its phases, `report_phases`), ray_report (the same on Ray Train
V2: Ray's report(), which copies the tree to storage_path), outlast_move (upload_dir(move=True): the files are given up, as ASYNC
reports and save_async do), ray (Ray Train V2's copy: pyarrow copy_files with Ray's
settings), dcp / dcp_async (torch.distributed.checkpoint save and
async_save of a state dict holding the same bytes as tensors; restore = dcp.load),
save_async (outlast's staged save: copy into memory, torch.save, upload_dir(move)),
torchsave+M (the state dict torch.save'd into a temporary directory, then saved with M:
what a Ray Train script's loop waits for, with M = ray or outlast).
Prints {"s": seconds to done, "blocked_s": seconds the caller was blocked, "bytes": n, "phases": {...}}.
"""
import argparse
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def size_of(src):
    return sum(f.stat().st_size for f in Path(src).rglob("*") if f.is_file())


def tensors_of(src):
    """The tree's files as uint8 tensors, keyed by relative path: a state dict of the same bytes."""
    import torch
    return {p.relative_to(src).as_posix(): torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8)
            for p in sorted(Path(src).rglob("*")) if p.is_file()}


def split(url):
    root, _, leaf = url.rstrip("/").rpartition("/")
    return root, leaf


def pyarrow_fs(url):
    import pyarrow.fs
    return pyarrow.fs.FileSystem.from_uri(url if "://" in url else os.path.abspath(url))


def outlast_run(dest):
    """(storage, run dir, checkpoint name) of a destination ROOT/RUN/NAME."""
    from outlast.storage import open_storage
    root, leaf = split(dest)
    top, run = split(root)
    return open_storage(top), run, leaf


def outlast_manifest(storage, run, leaf, entries):
    from outlast.storage.records import Manifest
    from outlast.storage.run_store import RunStore
    RunStore(storage, run).write_manifest(Manifest(checkpoint_dir=leaf, seq=1, attempt=1, report_index=0,
                                                  committed_at=time.time(), ranks=[0], files=entries))


def copy_parallel(src, dest, fsync):
    """Every file of `src` copied to the same place under `dest` by a pool of threads (and with `fsync`, each
    file then fsynced, and every directory once its files are in)."""
    files = [p.relative_to(src) for p in sorted(Path(src).rglob("*")) if p.is_file()]
    dirs = sorted({Path(dest) / f.parent for f in files} | {Path(dest)})
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)

    def one(rel):
        shutil.copyfile(Path(src) / rel, Path(dest) / rel)
        if fsync:
            fd = os.open(Path(dest) / rel, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    with ThreadPoolExecutor(max_workers=max(8, 2 * (os.cpu_count() or 1))) as pool:
        list(pool.map(one, files))
    if fsync:
        for d in dirs + [Path(dest).parent]:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


SETTLE_S = 20.0


def _timed_report(config):
    """The train function of outlast_report and ray_report: one report() of the tree, its seconds written to
    config["out"]. It waits SETTLE_S first, as a loop reports after its first steps: the run's start-up is
    over by then (outlast's standby fork server, started 10 s in, imports its modules on the same cores)."""
    import importlib

    train = importlib.import_module(f"{config['framework']}.train")
    time.sleep(SETTLE_S)
    began, t0 = time.time(), time.perf_counter()
    train.report({"step": 0}, checkpoint=train.Checkpoint.from_directory(config["src"]))
    seconds = time.perf_counter() - t0
    Path(config["out"]).write_text(json.dumps({"s": seconds, "began": began, "returned": began + seconds}))


def report_phases(trace, began, returned):
    """Where a SYNC report's seconds went, from the marks of its run (`outlast/trace.py`), each phase the time
    since the one before it: before_upload (report()'s own start), copies (to the last file placed in storage,
    copied and hashed), fsync_tail (to the last file fsynced), dirs (the directories' fsyncs after the files),
    to_controller (the report's message), controller (its step, to the manifest's write), manifest (its write
    and fsyncs), told (to the Committed sent), heard (to the worker's return from the wait), after (to report()'s
    return). tier_copy_after_return: when the node began its copy into memory, after report() returned (< 0:
    before)."""
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]

    def first(phase, after=began, **fields):
        return min((r["t"] for r in rows if r["phase"] == phase and r["t"] >= after
                    and all(r.get(k) == v for k, v in fields.items())), default=None)

    def last(phase, before):
        return max((r["t"] for r in rows if r["phase"] == phase and began <= r["t"] <= before), default=None)

    uploaded = first("report.uploaded")
    points = [("before_upload", first("report.upload_begin")), ("copies", last("upload.placed", uploaded)),
              ("fsync_tail", last("upload.fsynced", uploaded)), ("dirs", first("upload.dirs_fsynced")),
              ("to_controller", first("controller.report")), ("controller", first("storage.begin", effect="WriteManifest")),
              ("manifest", first("storage.end", effect="WriteManifest")), ("told", first("controller.committed")),
              ("heard", first("report.committed")), ("after", returned)]
    out, before = {}, began
    for name, at in points:
        if at is None:
            return {}  # a trace without the marks (an older outlast): no phases rather than wrong ones
        out[f"{name}_s"], before = at - before, at
    tier = first("tier.begin", kind="TierHold")
    if tier is not None:
        out["tier_copy_after_return_s"] = tier - returned
    return out


def outlast_report(src, dest):
    """A run of one rank on an embedded node (its memory tier at its default budget) whose train function
    reports the tree once, SYNC; storage_path is dest's parent, the run named by dest's last part. The
    run's start and end are not timed: the seconds are what report() took inside the worker."""
    from outlast.train import DataParallelTrainer, RunConfig, ScalingConfig

    from outlast.trace import ENV_VAR

    root, leaf = split(dest)
    with tempfile.TemporaryDirectory() as tmp:
        out, trace = os.path.join(tmp, "report.json"), Path(tmp, "trace.jsonl")
        os.environ[ENV_VAR] = str(trace)  # before the run: its node and worker inherit it
        DataParallelTrainer(_timed_report, train_loop_config={"src": os.path.abspath(src), "out": out,
                                                              "framework": "outlast"},
                            scaling_config=ScalingConfig(num_workers=1),
                            run_config=RunConfig(storage_path=os.path.abspath(root), name=leaf)).fit()
        timed = json.loads(Path(out).read_text())
        return timed["s"], report_phases(trace, timed["began"], timed["returned"])


def ray_report(src, dest):
    """outlast_report's run on Ray Train V2: one worker whose report() of the tree (SYNC, Ray's default) is
    timed inside it, 20 s into the run; storage_path is dest's parent. Ray starts inside fit(), untimed."""
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    import ray.train
    from ray.train.torch import TorchTrainer

    root, leaf = split(dest)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        TorchTrainer(_timed_report, train_loop_config={"src": os.path.abspath(src), "out": out, "framework": "ray"},
                     scaling_config=ray.train.ScalingConfig(num_workers=1),
                     run_config=ray.train.RunConfig(storage_path=os.path.abspath(root), name=leaf)).fit()
        return json.loads(Path(out).read_text())["s"]


def warm(method):
    """Imports a training process has done long before its checkpoint: never timed."""
    if method == "ray":
        import pyarrow.fs  # noqa: F401
        import ray.train.v2._internal.execution.storage  # noqa: F401
    elif method.startswith("outlast"):
        import outlast.storage.local  # noqa: F401
        import outlast.storage.restore  # noqa: F401


def save(method, src, dest):
    """Returns (blocked_s, done_s)."""
    root, leaf = split(dest)
    if method.startswith("torchsave+"):
        # Ray Train's pattern: torch.save into a temporary directory, then report it (upload).
        import torch
        state = tensors_of(src)
        warm(method.split("+", 1)[1])
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(src))) as tmp:
            torch.save(state, os.path.join(tmp, "model.pt"))
            save(method.split("+", 1)[1], tmp, dest)
        done = time.perf_counter() - t0
        return done, done
    if method == "outlast_report":
        done, phases = outlast_report(src, dest)
        return done, done, phases
    if method == "ray_report":
        done = ray_report(src, dest)
        return done, done
    t0 = time.perf_counter()
    if method == "copy":
        shutil.copytree(src, dest)
    elif method in ("copy_parallel", "copy_parallel_fsync"):
        copy_parallel(src, dest, fsync=method == "copy_parallel_fsync")
    elif method == "fsspec":
        import fsspec
        fs, path = fsspec.core.url_to_fs(root)
        fs.put(src.rstrip("/") + "/", f"{path}/{leaf}/", recursive=True)
    elif method in ("outlast", "outlast_move"):
        storage, run, leaf = outlast_run(dest)
        t0 = time.perf_counter()
        entries = storage.upload_dir(Path(src), f"{run}/{leaf}", move=method == "outlast_move")
        done = time.perf_counter() - t0
        outlast_manifest(storage, run, leaf, entries)  # untimed: the controller's one small write
        return done, done
    elif method == "ray":
        import pyarrow.fs
        from ray.train.v2._internal.execution.storage import _pyarrow_fs_copy_files
        fs, path = pyarrow_fs(root)
        t0 = time.perf_counter()
        fs.create_dir(f"{path}/{leaf}")
        _pyarrow_fs_copy_files(src, f"{path}/{leaf}", source_filesystem=pyarrow.fs.LocalFileSystem(),
                               destination_filesystem=fs)
    elif method in ("dcp", "dcp_async"):
        import torch.distributed.checkpoint as dcp
        state = tensors_of(src)
        t0 = time.perf_counter()
        if method == "dcp":
            dcp.save(state, checkpoint_id=dest)
        else:
            future = dcp.async_save(state, checkpoint_id=dest)
            blocked = time.perf_counter() - t0
            future.result()
            return blocked, time.perf_counter() - t0
    elif method == "save_async":
        import torch
        from outlast.train.torch.checkpoint import stage
        state, (storage, run, leaf) = tensors_of(src), outlast_run(dest)
        t0 = time.perf_counter()
        staged = stage(state)  # what the training loop waits for
        blocked = time.perf_counter() - t0
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(src))) as tmp:
            torch.save(staged, os.path.join(tmp, "model.pt"))
            entries = storage.upload_dir(Path(tmp), f"{run}/{leaf}", move=True)
        done = time.perf_counter() - t0
        outlast_manifest(storage, run, leaf, entries)
        return blocked, done
    else:
        raise ValueError(f"unknown method {method!r}")
    done = time.perf_counter() - t0
    return done, done


def restore(method, dest, into):
    root, leaf = split(dest)
    t0 = time.perf_counter()
    if method == "copy":
        shutil.copytree(dest, into)
    elif method == "fsspec":
        import fsspec
        fs, path = fsspec.core.url_to_fs(dest)
        fs.get(path.rstrip("/") + "/", into.rstrip("/") + "/", recursive=True)
    elif method.startswith("torchsave+"):
        return restore(method.split("+", 1)[1], dest, into)
    elif method in ("outlast", "outlast_move", "save_async"):
        from outlast.storage.restore import materialize
        storage, run, leaf = outlast_run(dest)
        t0 = time.perf_counter()
        materialize(storage, run, leaf, Path(into))  # in place on a file system, checked either way
    elif method == "ray":
        import pyarrow.fs
        from ray.train.v2._internal.execution.storage import _pyarrow_fs_copy_files
        fs, path = pyarrow_fs(dest)
        os.makedirs(into)
        t0 = time.perf_counter()
        _pyarrow_fs_copy_files(path, into, source_filesystem=fs,
                               destination_filesystem=pyarrow.fs.LocalFileSystem())
    elif method in ("dcp", "dcp_async"):
        import torch
        import torch.distributed.checkpoint as dcp
        meta = dcp.FileSystemReader(dest).read_metadata()
        state = {k: torch.empty(v.size, dtype=torch.uint8) for k, v in meta.state_dict_metadata.items()}
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=dest)
    else:
        raise ValueError(f"unknown method {method!r}")
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", required=True)
    p.add_argument("--op", choices=["save", "restore"], required=True)
    p.add_argument("--src", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--into", help="restore: the local directory to restore into (a node cache for outlast)")
    args = p.parse_args()
    n = size_of(args.src)
    if args.op == "save":
        blocked, done, *phases = save(args.method, args.src, args.dest)
        print(json.dumps({"s": done, "blocked_s": blocked, "bytes": n, "phases": phases[0] if phases else {}}))
    else:
        print(json.dumps({"s": restore(args.method, args.dest, args.into), "bytes": n}))


if __name__ == "__main__":
    main()
