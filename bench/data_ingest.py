"""Ingest beside Ray 2.60's Ray Data, in the same run: the same parquet files and the same images, read by a
TorchTrainer of 2 workers through `get_dataset_shard("train").iter_torch_batches`, one epoch.

    python3 -m bench.data_ingest [--repeats 3] [--gb 1.0] [--images 10000] [--ray-python bench/.ray-venv/bin/python]
        [--out bench/results/data-ingest.json]

The data is made here, in a temporary directory: parquet files of about `--gb` GB in all (a vector of 256
float32 and an int64 label a row, 8 files of row groups of 8192 rows), and `--images` 64x64 JPEGs made
with Pillow. Both sides run bench/lib/ingest_scenario.py, which spells the same script with `ray.*` or
`outlast.*` (outlast's side imports outlast.data, what `ray.data` is under `outlast run`). Each repeat runs each dataset once on each side,
alternating which goes first. Figures: rows per second (all ranks' rows over the time from the first rank's
first request to the last rank's last batch), the whole run's wall time (starting the framework included),
and the peak PSS of every process the run started (sampled every 0.5 s), each with the 1-minute load average
when the run began; the ratios are outlast over Ray (throughput: above 1 is outlast faster; memory: below 1
is outlast smaller). Ray starts with `--ray-cpus` logical CPUs, one per train worker and the rest for Ray
Data's read tasks (with only the workers' CPUs, its reads would wait for a CPU forever).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from bench.lib import harness, proctree, venvs
from bench.lib.events import read_events

RUN_VAR = "OUTLAST_BENCH_INGEST_RUN"  # carried by every process a run starts: what the sampler sums


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_parquet(directory: str, gb: float, files: int = 8, row_group: int = 8192) -> int:
    """Rows of a 256-float32 vector ("x", a fixed-size list) and an int64 label: about 1 KiB a row."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory)
    rows_per_file = int(gb * 2**30 / (256 * 4 + 8) / files)
    rng = np.random.default_rng(0)
    for f in range(files):
        x = rng.standard_normal(rows_per_file * 256, dtype=np.float32)
        table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x), 256),
                          "label": np.arange(f * rows_per_file, (f + 1) * rows_per_file, dtype=np.int64)})
        pq.write_table(table, os.path.join(directory, f"part-{f:02d}.parquet"), row_group_size=row_group)
        del x, table
    return rows_per_file * files


def make_images(directory: str, count: int, size: int = 64) -> int:
    import numpy as np
    from PIL import Image

    os.makedirs(directory)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
    for i in range(count):
        pixels = np.roll(base, i % size, axis=i % 2)  # JPEG-sized like a photo thumbnail, each different
        Image.fromarray(pixels).save(os.path.join(directory, f"img-{i:05d}.jpg"), quality=85)
    return count


class TreeMemory:
    """The peak total PSS of the processes that carry RUN_VAR=`run` (and their children), sampled."""

    def __init__(self, run: str, since: float, interval: float = 0.5) -> None:
        self.run, self.since, self.interval, self.peak = run, since, interval, 0
        self._before = proctree.pids()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            total = 0
            for p in proctree.ours(RUN_VAR, self.run, self._before, self.since):
                try:
                    total += p.memory_full_info().pss
                except Exception:  # noqa: BLE001 - gone between the listing and the read
                    continue
            self.peak = max(self.peak, total)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def run_one(fw: str, kind: str, data_dir: str, args: argparse.Namespace, workdir: str) -> dict | None:
    run = uuid.uuid4().hex[:12]
    events = os.path.join(workdir, f"{fw}-{kind}-{run}.jsonl")
    logfile = os.path.join(workdir, f"{fw}-{kind}-{run}.log")
    python = args.ray_python if fw == "ray" else sys.executable
    cmd = venvs.module(python, "bench.lib.ingest_scenario", "--framework", fw, "--kind", kind, "--data", data_dir,
                       "--events", events, "--storage", os.path.join(workdir, f"storage-{run}"),
                       "--batch-size", str(args.batch_size), "--ray-cpus", str(args.ray_cpus))
    env = {**os.environ, RUN_VAR: run, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_V2_ENABLED": "1"}
    if fw == "ray" and args.ray_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [venvs.ROOT, args.ray_pythonpath]))
    env = venvs.with_root(env)
    load = harness.load()[0]
    since = time.time()
    with open(logfile, "w") as out, TreeMemory(run, since) as memory:
        proc = subprocess.Popen(cmd, env=env, cwd=venvs.ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            proctree.killpg(proc.pid)
            proc.wait()
    wall = time.time() - since
    left = proctree.ours(RUN_VAR, run, (), since)
    if left:
        proctree.kill_all(left)
    ranks = read_events(events)
    if rc != 0 or len(ranks) != args.workers:
        log(f"{fw} {kind}: rc={rc}, {len(ranks)} ranks reported; see {logfile}")
        return None
    rows = sum(r["rows"] for r in ranks)
    seconds = max(r["end"] for r in ranks) - min(r["start"] for r in ranks)
    figs = {"rows": rows, "rows_per_rank": sorted(r["rows"] for r in ranks),
            "batches_per_rank": sorted(r["batches"] for r in ranks), "rows_per_s": rows / seconds,
            "ingest_s": seconds, "wall_s": wall, "peak_pss_mib": memory.peak / 2**20, "load1": load}
    log(f"{fw} {kind}: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in figs.items()})}")
    return figs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--images", type=int, default=10000)
    p.add_argument("--sides", nargs="+", default=["outlast", "ray"], choices=["outlast", "ray"])
    p.add_argument("--kinds", nargs="+", default=["parquet", "images"], choices=["parquet", "images"])
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ray-cpus", type=int, default=4)
    p.add_argument("--ray-python", default=venvs.RAY_PY)
    p.add_argument("--ray-pythonpath", default="",
                   help="more import paths for Ray's side (Pillow, when its virtual environment lacks it)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--out", help="also write the JSON document here (bench/results/data-ingest.json)")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="outlast-bench-ingest-")
    harness.private_state_dirs(workdir)
    load_before = harness.load()
    started = time.time()
    datasets = {}
    if "parquet" in args.kinds:
        datasets["parquet"] = os.path.join(workdir, "parquet")
        log(f"parquet: {make_parquet(datasets['parquet'], args.gb)} rows in {datasets['parquet']}")
    if "images" in args.kinds:
        datasets["images"] = os.path.join(workdir, "images")
        log(f"images: {make_images(datasets['images'], args.images)} in {datasets['images']}")
    sizes = {k: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)) for k, d in datasets.items()}
    runs: dict[str, dict[str, list[dict]]] = {k: {"ray": [], "outlast": []} for k in datasets}
    for _, fw in harness.interleaved(args.sides, args.repeats):
        for kind, directory in datasets.items():
            figs = run_one(fw, kind, directory, args, workdir)
            if figs is not None:
                runs[kind][fw].append(figs)
    for directory in datasets.values():
        shutil.rmtree(directory, ignore_errors=True)  # a GB of files; the runs' logs stay in the work directory
    figures = {}
    for kind, sides in runs.items():
        per_side = {fw: harness.summarize_runs([{k: v for k, v in r.items() if not isinstance(v, list)}
                                               for r in rs]) for fw, rs in sides.items()}
        ratios = {}
        for key in ("rows_per_s", "peak_pss_mib", "wall_s"):
            o, r = per_side["outlast"].get(key), per_side["ray"].get(key)
            ratios[key] = None if o is None or r is None or harness.ratio(o, r) is None else round(
                harness.ratio(o, r), 3)
        figures[kind] = {"bytes_on_disk": sizes[kind], "outlast": per_side["outlast"], "ray": per_side["ray"],
                         "outlast_over_ray": ratios,
                         "runs": {fw: [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
                                       for r in rs] for fw, rs in sides.items()}}
    versions = {}
    for fw, python in (("outlast", sys.executable), ("ray", args.ray_python)):
        code = ("import importlib.metadata as m, json, pyarrow, torch; print(json.dumps({'torch': torch.__version__, "
                f"'pyarrow': pyarrow.__version__, '{fw}': (m.version('ray') if '{fw}' == 'ray' else 'source')}}))")
        try:
            versions[fw] = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                                     timeout=120).stdout.strip().splitlines()[-1])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            versions[fw] = None
    doc = {"benchmark": "data-ingest", "date": harness.stamp(), "figures": figures,
           "machine": harness.machine(versions),
           "load": {"before": load_before, "after": harness.load(),
                    "note": "a shared machine: each run carries load1, the 1-minute load average when it began"},
           "settings": {"repeats": args.repeats, "gb": args.gb, "images": args.images, "batch_size": args.batch_size,
                        "workers": args.workers, "ray_logical_cpus": args.ray_cpus,
                        "through": "TorchTrainer(num_workers=2) on both sides, one epoch of "
                                   "get_dataset_shard('train').iter_torch_batches(batch_size) on CPU"},
           "took_s": round(time.time() - started, 1)}
    harness.publish(doc, args.out)


if __name__ == "__main__":
    venvs.in_project_venv("bench.data_ingest", "psutil", "pyarrow", "PIL")
    main()
