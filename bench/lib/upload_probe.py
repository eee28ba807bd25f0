"""Times one copy of a checkpoint directory to storage, one way.

    python -m bench.lib.upload_probe --method M --src DIR --dest DIR_OR_S3_URL

Methods: copytree (shutil, the plain-copy limit on a file system), fsspec
(a plain recursive put, the limit on S3), outlast (outlast.storage's
upload_dir, which hashes while it copies), ray (what Ray Train V2's
StorageContext.persist_current_checkpoint does: create the directory, then
pyarrow.fs.copy_files with Ray's settings). Prints {"s": seconds, "bytes": n}.
S3 takes its endpoint and keys from the AWS_* environment variables.
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


_clients = {}  # one storage client per destination root, as a training run keeps one


def client(key, make):
    if key not in _clients:
        _clients[key] = make()
    return _clients[key]


def upload(method, src, dest):
    root, _, leaf = dest.rstrip("/").rpartition("/")
    if method == "copytree":
        shutil.copytree(src, dest)
    elif method == "fsspec":
        import fsspec
        fs, path = client(("fsspec", root), lambda: fsspec.core.url_to_fs(root))
        fs.put(src.rstrip("/") + "/", f"{path}/{leaf}/", recursive=True)
    elif method == "outlast":
        from outlast.storage import open_storage
        client(("outlast", root), lambda: open_storage(root)).upload_dir(Path(src), leaf)
    elif method == "ray":
        import pyarrow.fs
        from ray.train.v2._internal.execution.storage import _pyarrow_fs_copy_files
        fs, path = client(("ray", root), lambda: pyarrow_fs(root))
        fs.create_dir(f"{path}/{leaf}")
        _pyarrow_fs_copy_files(src, f"{path}/{leaf}", source_filesystem=pyarrow.fs.LocalFileSystem(),
                               destination_filesystem=fs)
    else:
        raise ValueError(f"unknown method {method!r}")


def remove(method, dest):
    """Untimed: the storage must not fill up over repeated runs (moto keeps objects in memory)."""
    if "://" not in dest:
        shutil.rmtree(dest, ignore_errors=True)
    elif method == "ray":
        fs, path = pyarrow_fs(dest)
        fs.delete_dir(path)
    else:
        import fsspec
        fs, path = fsspec.core.url_to_fs(dest)
        fs.rm(path, recursive=True)


def pyarrow_fs(url):
    import pyarrow.fs
    return pyarrow.fs.FileSystem.from_uri(url if "://" in url else os.path.abspath(url))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", required=True,
                   choices=["copytree", "fsspec", "outlast", "ray"])
    p.add_argument("--src", required=True)
    p.add_argument("--dest", required=True)
    args = p.parse_args()
    n = size_of(args.src)
    # A tiny upload first, untimed: imports, clients and connections are set
    # up already in a training process that uploads its second checkpoint.
    with tempfile.TemporaryDirectory() as tiny:
        Path(tiny, "x").write_bytes(b"x")
        upload(args.method, tiny, args.dest + "-warmup")
    t0 = time.perf_counter()
    upload(args.method, args.src, args.dest)
    elapsed = time.perf_counter() - t0
    for dest in (args.dest, args.dest + "-warmup"):
        remove(args.method, dest)
    print(json.dumps({"s": elapsed, "bytes": n}))


if __name__ == "__main__":
    main()
