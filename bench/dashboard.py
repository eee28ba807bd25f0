"""Dashboard benchmark: how long each page takes to load in a real browser for a long run.

    python3 -m bench.dashboard [--repeat 5] [--attempts 100] [--reports 10000] [--parts local,s3] [--out FILE]

Builds one run's documents as the driver writes them (its run state and rank 0's report segments,
through RunStore): --attempts attempts sharing --reports reports, each attempt ended by a failure
with a traceback, a checkpoint committed every 25 reports (with its manifest), a drain and a resize
every tenth attempt, and four ranks' output files named per attempt. On a local directory and on
S3 (a moto server on loopback: in-process Python, far slower than a real store). Then
`outlast dashboard` serves it, and headless chromium (Debian's, through Playwright) loads each page
in a fresh browser context until it is drawn:

  runs_page_s     the Runs page until the run's row is in its table
  run_page_s      a run's page until the timeline has every attempt and the chart every report
  run_api_s       the run's JSON document alone (what the page fetches), fetched after the page; its size
  cluster_page_s  the Cluster page until it says what it found (no node runs here: its message)

Each repeat starts a fresh `outlast dashboard` and loads every page twice: the first load reads
everything from storage; `again_*` is the second, after the server has kept the reports of the
attempts that ended (what a page refreshing every 2 s, or the next visitor, pays).

Ray 2.60 has no counterpart to compare with: its dashboard shows runs of a live cluster only, not
a run's history read from storage, so no ratio is given. One JSON document on stdout (and --out).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench.lib import venvs
from bench.lib.venvs import OUTLAST_PY

venvs.in_project_venv(__spec__.name, "psutil", "playwright")

from bench.lib import harness  # noqa: E402
from outlast.storage import open_storage  # noqa: E402
from outlast.storage.records import (  # noqa: E402
    REPORTS_PER_SEGMENT, AttemptRecord, CheckpointRecord, DrainRecord, FailureRecord, Manifest, OutputFile,
    ReportEntry, ReportSegment, ResizeRecord, RunState,
)
from outlast.protocol.messages import FileEntry  # noqa: E402
from outlast.storage.run_store import RunStore  # noqa: E402
from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from tests.browser.server import Dashboard  # noqa: E402

TRACEBACK = "".join(f'  File "/srv/train.py", line {i}, in step\n    loss = model(batch)\n' for i in range(20)) \
    + "RuntimeError: CUDA error: an illegal memory access was encountered\n"


def build(storage_path: str, name: str, attempts: int, reports: int, log_dir: str) -> None:
    store = RunStore(open_storage(storage_path), name)
    per = reports // attempts
    t, step = 1.7e9, 0
    state = RunState(name=name, status="finished", created_at=t, updated_at=t)
    latest = None
    for a in range(1, attempts + 1):
        workers = 4 if a % 10 else 3
        record = AttemptRecord(attempt=a, started_at=t, restored_from=latest, workers=workers,
                               outputs=[OutputFile(rank=r, node_id=f"node-{r}", path=f"{log_dir}/a{a}-r{r}.log")
                                        for r in range(workers)])
        entries = []
        for i in range(per):
            entries.append(ReportEntry(index=i, time=t, metrics={"step": step, "loss": 1.0 / (1 + 0.001 * step),
                                                                 "lr": 1e-3, "tokens_per_s": 51234.5}))
            if (i + 1) % 25 == 0:
                latest = f"checkpoint_{a:03d}_{i:06d}"
                files = [FileEntry(path="model.pt", size=64 << 20, xxh3_128="0" * 32)]
                store.write_manifest(Manifest(checkpoint_dir=latest, seq=len(state.checkpoints) + 1, attempt=a,
                                              report_index=i, committed_at=t, ranks=[0], files=files,
                                              metrics=entries[-1].metrics))
                state.checkpoints.append(CheckpointRecord(checkpoint_dir=latest, seq=len(state.checkpoints) + 1,
                                                          attempt=a, report_index=i, committed_at=t,
                                                          metrics=entries[-1].metrics))
            t += 0.5
            step += 1
        for first in range(0, len(entries), REPORTS_PER_SEGMENT):
            store.write_reports(ReportSegment(attempt=a, first_index=first,
                                              reports=entries[first:first + REPORTS_PER_SEGMENT]))
        if a % 10 == 5:
            state.drains.append(DrainRecord(attempt=a, node_ids=["node-3"], reason="preemption",
                                            message="spot instance reclaimed", time=t - 5, deadline=t + 25, ranks=[3]))
        if a % 10 == 0 and a > 1:
            state.resizes.append(ResizeRecord(attempt=a, from_workers=4, to_workers=3, reason="node node-3 drained",
                                              steps_lost=0, time=record.started_at))
        if a < attempts:
            record.failures = [FailureRecord(attempt=a, rank=a % workers, node_id=f"node-{a % workers}", pid=1000 + a,
                                             exit_code=1, signal=None, time=t, exc_type="RuntimeError",
                                             message="CUDA error: an illegal memory access was encountered",
                                             traceback=TRACEBACK, phase="train")]
            record.outcome, record.ended_at = "failed", t
            state.failure_counts["worker"] = state.failure_counts.get("worker", 0) + 1
        else:
            record.outcome, record.ended_at = "finished", t
        state.attempts.append(record)
        t += 3.0
    state.latest_checkpoint = latest
    state.updated_at = t
    store.save_state(state)


def measure(browser, url: str, reports: int, attempts: int) -> dict:
    out = {}
    for key, path, ready in [
        ("runs_page_s", "/runs", "() => document.querySelector('tr[data-run=long]') !== null"),
        ("run_page_s", "/runs/0/long",
         f"() => document.querySelectorAll('.tl-attempt').length === {attempts} && "
         f"Number((document.getElementById('chart') || {{dataset: {{}}}}).dataset.points) === {reports}"),
        ("cluster_page_s", "/cluster", "() => document.querySelector('#error, table.nodes') !== null"),
    ]:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        start = time.perf_counter()
        page.goto(url + path)
        page.wait_for_function(ready, timeout=300_000, polling=10)
        out[key] = time.perf_counter() - start
        context.close()
    start = time.perf_counter()
    body = urllib.request.urlopen(f"{url}/api/runs/0/long", timeout=300).read()
    out["run_api_s"] = time.perf_counter() - start
    out["run_api_bytes"] = len(body)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--attempts", type=int, default=100)
    p.add_argument("--reports", type=int, default=10_000)
    p.add_argument("--parts", default="local,s3")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    work = tempfile.mkdtemp(prefix="outlast-bench-dashboard-")
    moto = None
    doc = {"benchmark": "dashboard", "started": harness.stamp(), "load_before": harness.load(),
           "attempts": args.attempts, "reports": args.reports, "repeat": args.repeat,
           "ray": "no counterpart: Ray 2.60's dashboard shows a live cluster's runs, not a run's history on storage",
           "machine": harness.machine({"chromium": subprocess.run([CHROMIUM, "--version"], capture_output=True,
                                                                  text=True).stdout.strip()}),
           "parts": {}}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            for part in args.parts.split(","):
                env = {"OUTLAST_HOME": os.path.join(work, "home")}
                if part == "s3":
                    moto, aws = harness.start_s3(work, OUTLAST_PY)
                    env.update(aws)
                    os.environ.update(env)
                    storage_path = "s3://bench/runs"
                else:
                    storage_path = os.path.join(work, "storage")
                started = time.perf_counter()
                build(storage_path, "long", args.attempts, args.reports, os.path.join(work, "logs"))
                built_s = time.perf_counter() - started
                runs = []
                for _ in range(args.repeat):
                    d = Dashboard(storage_path, "--timeout", "120", env=env)  # a fresh server: nothing kept yet
                    try:
                        cold = measure(browser, d.url, args.reports, args.attempts)
                        warm = measure(browser, d.url, args.reports, args.attempts)
                    finally:
                        d.stop()
                    runs.append({**cold, **{f"again_{k}": v for k, v in warm.items() if "bytes" not in k}})
                doc["parts"][part] = {"storage": storage_path, "build_s": round(built_s, 2),
                                      **harness.summarize_runs(runs), "load_after": harness.load()}
                print(json.dumps({part: doc["parts"][part]}), file=sys.stderr)
            browser.close()
    finally:
        if moto is not None:
            moto.kill()
            moto.wait()
        shutil.rmtree(work, ignore_errors=True)
    doc["load_after"] = harness.load()
    harness.publish(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
