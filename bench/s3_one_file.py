"""Why one large file to S3 may go slower through outlast than a plain fsspec `put`: each
part of the difference on its own, interleaved, in one process with warm clients.

    .venv/bin/python -m bench.s3_one_file [--mb 128] [--repeat 7] [--out FILE]

A moto server (its own process) on loopback. Methods, each on a fresh key:
  fsspec_put     fs.put(file, key): the floor
  put_file       fs.put_file from one of outlast's I/O threads, no checksum
  outlast        RemoteStorage.upload_dir (put_file and xxh3 side by side)
  outlast_cold   the same with a RemoteStorage made inside the timing (its client's set-up counted)
  fsspec_probe, outlast_probe
                 bench/lib/checkpoint_probe.py's save in a fresh process, its own timing: what
                 bench/checkpoint.py measures
MB/s median and range, ratios to fsspec_put, the load average. JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib import harness
from bench.lib.venvs import ROOT, module, with_root


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=128, help="the file's size in MiB")
    p.add_argument("--repeat", type=int, default=7, help="rounds, each method once a round")
    p.add_argument("--out", help="also write the JSON document here")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="outlast-s3-one-")
    moto, url = harness.start_moto(work, sys.executable)
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        import fsspec

        from outlast.storage import priority
        from outlast.storage.remote import RemoteStorage

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("bench")
        src = Path(work, "src")
        src.mkdir()
        with open(src / "model.bin", "wb") as f:
            f.write(os.urandom(args.mb << 20))
        warm = RemoteStorage("s3://bench/outlast")
        warm.upload_dir(src, "warm")  # the client and the I/O pool, as a training process has them

        def fsspec_put(i):
            fs.put(str(src / "model.bin"), f"bench/plain/{i}/model.bin")

        def put_file(i):
            priority.submit(warm.fs.put_file, str(src / "model.bin"), f"bench/outlast/pf{i}/model.bin").result()

        def probe(method):
            def run(i):
                out = subprocess.run(module(sys.executable, "bench.lib.checkpoint_probe", "--method", method,
                                            "--op", "save", "--src", str(src), "--dest", f"s3://bench/probe/{method}{i}"),
                                     capture_output=True, text=True, check=True, cwd=ROOT, env=with_root(os.environ))
                return json.loads(out.stdout.strip().splitlines()[-1])["s"]
            return run

        methods = {"fsspec_put": fsspec_put, "put_file": put_file,
                   "outlast": lambda i: warm.upload_dir(src, f"o{i}"),
                   "outlast_cold": lambda i: RemoteStorage("s3://bench/outlast").upload_dir(src, f"c{i}"),
                   "fsspec_probe": probe("fsspec"), "outlast_probe": probe("outlast")}
        runs: dict[str, list] = {k: [] for k in methods}
        loads = []
        for i in range(args.repeat):
            for name, fn in methods.items():
                t0 = time.perf_counter()
                took = fn(i)  # a probe times itself, without its process's start
                runs[name].append((args.mb << 20) / 1e6 / (took if isinstance(took, float) else time.perf_counter() - t0))
            loads.append(os.getloadavg()[0])
        figs = {k: harness.summary(v) for k, v in runs.items()}
        doc = {"benchmark": "s3_one_file", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "MB": (args.mb << 20) / 1e6, "cpus": os.cpu_count(), "load1": harness.summary(loads),
               "save_MBps": figs,
               "over_fsspec_put": {k: harness.ratio(v, figs["fsspec_put"]) for k, v in figs.items()}}
    finally:
        moto.kill()
    harness.publish(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
