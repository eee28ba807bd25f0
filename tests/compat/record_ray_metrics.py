"""Records what a Ray example prints under the real Ray, for test_ray_metrics.py to compare `outlast run` with.

    python3 tests/compat/record_ray_metrics.py [--ray-python bench/.ray-venv/bin/python] [--runs 2]

Runs Ray's torch_linear_example.py (from the wheel that tests/compat fetches, unchanged: 3 epochs, with
`--num-workers 1` and with `--num-workers 2`) with Ray's Python (bench/setup_ray_venv.sh builds it), with
tests/compat/seeded on its PYTHONPATH so that torch's default generator is seeded as torch is imported, in
the driver and in every worker. It runs each case `--runs` times, checks that Ray prints the same metrics each
time, and writes them to tests/compat/ray_metrics.json with Ray's and torch's versions and the script's
SHA-256. Run it again when the example or Ray's version changes (the test says so).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RECORD = HERE / "ray_metrics.json"
SEEDED = HERE / "seeded"
SCRIPT = "ray/train/examples/pytorch/torch_linear_example.py"
CASES = (("--num-workers", "1"), ("--num-workers", "2"))  # each: the script's arguments


def printed_metrics(stdout: str) -> dict:
    """The metrics the example prints last (`print(result.metrics)`: a dict literal on a line of its own)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                value = ast.literal_eval(line)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, dict):
                return value
    raise ValueError(f"no printed metrics (a dict on a line of its own) in the output:\n{stdout[-2000:]}")


def script_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ray-python", default=str(ROOT / "bench" / ".ray-venv" / "bin" / "python"),
                   help="a Python with Ray installed (bench/setup_ray_venv.sh)")
    p.add_argument("--runs", type=int, default=2, help="how many times to run it under Ray (all must agree)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from outlast.compat.ray_source import ray_source

    script = ray_source() / SCRIPT
    versions = json.loads(subprocess.run(
        [args.ray_python, "-c", "import json, ray, torch; print(json.dumps([ray.__version__, torch.__version__]))"],
        capture_output=True, text=True, check=True).stdout)
    cases = []
    for case in CASES:
        seen = []
        for n in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                env = dict(os.environ, PYTHONPATH=str(SEEDED))
                proc = subprocess.run([args.ray_python, str(script), *case], cwd=tmp, env=env, capture_output=True,
                                      text=True, timeout=900)
            if proc.returncode != 0:
                sys.exit(f"Ray's run {n + 1} of {' '.join(case)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
            seen.append(printed_metrics(proc.stdout))
            print(f"{' '.join(case)}, run {n + 1}: {seen[-1]}", file=sys.stderr)
        if any(m != seen[0] for m in seen):
            sys.exit(f"Ray printed different metrics in its {args.runs} runs of {' '.join(case)}: {seen}; "
                     "nothing recorded")
        cases.append({"args": list(case), "metrics": seen[0]})
    record = {"script": SCRIPT, "script_sha256": script_hash(script),
              "ray_version": versions[0], "torch_version": versions[1],
              "pythonpath": SEEDED.relative_to(ROOT).as_posix(), "runs_that_agreed": args.runs, "cases": cases}
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {RECORD.relative_to(ROOT)}: {cases}", file=sys.stderr)


if __name__ == "__main__":
    main()
