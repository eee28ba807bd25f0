"""The GPU path, case by case (run it through scripts/gpu-check; docs/gpu.md says what each shows).

    python -m bench.gpu_check [--only NAME,...] [--out PATH] [--budget-s 450]

Each case runs in a process of its own, with its own nodes (`LocalCluster`, told of the GPUs) and
storage, under a time limit, and prints one JSON line: `case`, `status` (passed, failed, skipped),
`seconds`, what it measured (`figures`) and, when it did not pass, `error`. A last line sums up.
The exit status is 1 when any case failed (no CUDA device fails them all), else 0. Cases that need
more GPUs than the machine has are skipped, saying so. With a device, the lines are also written
to --out (bench/results/gpu-check.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.lib.gpu_cases import CASES
from bench.lib.venvs import ROOT, module, with_root

DEFAULT_OUT = os.path.join(ROOT, "bench", "results", "gpu-check.json")


def probe() -> dict:
    """What this Python has of torch and CUDA, asked without touching a GPU in this process."""
    try:
        import torch
    except ImportError as e:
        return {"torch": None, "devices": 0, "why": f"torch is not installed for {sys.executable} ({e})"}
    info = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "nccl": None}
    try:
        v = torch.cuda.nccl.version() if torch.version.cuda else None  # a tuple, or an int on older torch
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else v
    except Exception as e:  # NCCL missing from the build: the cases will say what fails
        info["nccl"] = f"unknown ({type(e).__name__}: {e})"
    # In a child: the driver process stays free of CUDA, like the nodes' fork servers.
    code = ("import json, torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; "
            "print(json.dumps({'devices': n, 'names': [torch.cuda.get_device_name(i) for i in range(n)], "
            "'memory_gb': [round(torch.cuda.get_device_properties(i).total_memory / 1e9, 1) for i in range(n)]}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    try:
        info.update(json.loads(out.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError):
        info.update(devices=0, why=f"asking torch for CUDA devices failed: {out.stderr.strip()[-400:]}")
    if not info.get("devices"):
        info.setdefault("why", f"no CUDA device: torch {info['torch']} (CUDA build: {info['cuda_build'] or 'none'}) "
                               "sees no GPU; install a CUDA build of torch (docs/gpu.md) on a machine with one")
    return info


def verdict(lines: list[dict]) -> int:
    """The exit status: 1 when any case failed, else 0 (skipped cases are not failures)."""
    return 1 if any(line["status"] == "failed" for line in lines) else 0


def decide(case, machine: dict, elapsed_s: float, budget_s: float) -> dict | None:
    """A case's line when it is not to run (no device, too few GPUs, no time left), else None."""
    if not machine.get("devices"):
        return {"status": "failed", "error": machine["why"]}
    if case.gpus > machine["devices"]:
        return {"status": "skipped", "error": f"needs {case.gpus} GPUs, this machine has {machine['devices']} "
                                              "(NCCL refuses two ranks on one device); kept ready, not run"}
    if elapsed_s > budget_s:
        return {"status": "failed", "error": f"not started: the check's {budget_s:.0f} s were spent"}
    return None


def run_case(name: str, limit_s: float) -> dict:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"outlast-gpu-{name}-") as work:
        env = with_root({**os.environ, "OUTLAST_HOME": os.path.join(work, "home"), "OUTLAST_CAPACITY_TIMEOUT_S": "60"})
        try:
            proc = subprocess.run(module(sys.executable, __spec__.name, "--case", name, "--work", work), env=env,
                                  cwd=ROOT, capture_output=True, text=True, timeout=limit_s, start_new_session=True)
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")[-800:]
            return {"status": "failed", "error": f"did not finish within {limit_s:.0f} s",
                    "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    seconds = round(time.monotonic() - t0, 1)
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"status": "failed", "seconds": seconds, "error": f"the case exited with {proc.returncode} "
                f"and no result", "stderr_tail": proc.stderr[-800:]}
    if result["status"] != "passed":
        result["stderr_tail"] = proc.stderr[-800:]
    return {**result, "seconds": seconds}


def one_case(name: str, work: str) -> None:
    """In the case's own process: run it, print its result as the last line."""
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    case = next(c for c in CASES if c.name == name)
    try:
        figures, problems = case.fn(work)
        out = {"status": "failed" if problems else "passed", "figures": figures}
        if problems:
            out["error"] = "; ".join(problems)
    except Exception as e:
        out = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000]}
    sys.stdout.flush()
    print(json.dumps(out, default=str), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated case names (default: all)")
    p.add_argument("--out", default=None, help=f"where the lines go as one JSON document (default, with a "
                                                f"device: {os.path.relpath(DEFAULT_OUT, ROOT)})")
    p.add_argument("--budget-s", type=float, default=400.0, help="start no case after this many seconds (each ends within 60 s more)")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        one_case(args.case, args.work)
        return 0
    wanted = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {c.name for c in CASES}
    if unknown:
        print(f"unknown case(s) {sorted(unknown)}; the cases are {[c.name for c in CASES]}", file=sys.stderr)
        return 2
    machine = probe()
    lines, start = [], time.monotonic()
    for case in wanted:
        elapsed = time.monotonic() - start
        line = decide(case, machine, elapsed, args.budget_s) or \
            run_case(case.name, min(case.limit_s, args.budget_s + 60 - elapsed))
        line = {"case": case.name, "gpus": case.gpus, **line}
        lines.append(line)
        print(json.dumps(line, default=str), flush=True)
    code = verdict(lines)
    summary = {"case": "summary", "status": "failed" if code else "passed", "machine": machine,
               "passed": sum(line["status"] == "passed" for line in lines),
               "failed": sum(line["status"] == "failed" for line in lines),
               "skipped": sum(line["status"] == "skipped" for line in lines),
               "seconds": round(time.monotonic() - start, 1), "load_avg_1m": os.getloadavg()[0],
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(summary, default=str), flush=True)
    out = args.out or (DEFAULT_OUT if machine.get("devices") else None)
    if out:
        with open(out, "w") as f:
            json.dump({"benchmark": "gpu-check", "cases": lines, "summary": summary}, f, indent=1, default=str)
            f.write("\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
