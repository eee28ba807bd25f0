"""One timed checkpoint transfer, one way, in a fresh process.

    python -m bench.lib.checkpoint_probe --method M --op save|restore --src DIR --dest DIR_OR_S3_URL

save: the files of --src into --dest; restore: --dest back into a new local directory.
Methods: copy (shutil.copytree: the plain floor on a file system), fsspec (a plain
recursive put/get: the floor on S3), outlast (upload_dir; restore = materialize, which
checks every file against the manifest), outlast_move (upload_dir(move=True): the files
are given up, as ASYNC reports and save_async do), ray (Ray Train V2's copy: pyarrow
copy_files with Ray's settings), dcp / dcp_async (torch.distributed.checkpoint save and
async_save of a state dict holding the same bytes as tensors; restore = dcp.load),
save_async (outlast's staged save: copy into memory, torch.save, upload_dir(move)),
torchsave+M (the state dict torch.save'd into a temporary directory, then saved with M:
what a Ray Train script's loop waits for, with M = ray or outlast).
Prints {"s": seconds to done, "blocked_s": seconds the caller was blocked, "bytes": n}.
"""
import argparse
import json
import os
import shutil
import tempfile
import time
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
    t0 = time.perf_counter()
    if method == "copy":
        shutil.copytree(src, dest)
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
        blocked, done = save(args.method, args.src, args.dest)
        print(json.dumps({"s": done, "blocked_s": blocked, "bytes": n}))
    else:
        print(json.dumps({"s": restore(args.method, args.dest, args.into), "bytes": n}))


if __name__ == "__main__":
    main()
