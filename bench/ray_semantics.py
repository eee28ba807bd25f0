"""What a Ray Train script's Result says on Ray 2.60 and on outlast: the same script, unchanged.

    python3 -m bench.ray_semantics [--ray-python bench/.ray-venv/bin/python]

Runs bench/lib/ray_semantics_script.py with Ray's Python and with `outlast run`, then prints one JSON
document: each side's answers, which fields agree, and each side's wall time (for information:
Ray's includes starting Ray).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.lib.venvs import BENCH, RAY_PY, ROOT

# A script as its user would run it, by its path (`python FILE`, `outlast run FILE`): it imports nothing of bench.
SCRIPT = os.path.join(BENCH, "lib", "ray_semantics_script.py")


def run(cmd: list[str]) -> tuple[dict, float]:
    print(f"[bench] {' '.join(cmd)}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    took = time.monotonic() - started
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}"}, took
    return json.loads(lines[-1]), took


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ray-python", default=RAY_PY,
                   help="a Python with ray[train]==2.60.0 and torch (bench/setup_ray_venv.sh makes one)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ray_out, ray_s = run([args.ray_python, SCRIPT, os.path.join(tmp, "ray")])
        outlast_out, outlast_s = run([sys.executable, "-m", "outlast.cli.main", "run", SCRIPT,
                                      os.path.join(tmp, "outlast")])
    keys = sorted(set(ray_out) | set(outlast_out))
    print(json.dumps({
        "ray": ray_out, "outlast": outlast_out,
        "agree": {k: ray_out.get(k) == outlast_out.get(k) for k in keys},
        "wall_s": {"ray": round(ray_s, 1), "outlast": round(outlast_s, 1)},
        "load_average_1m": round(os.getloadavg()[0], 1), "cpus": os.cpu_count(),
    }, indent=2))


if __name__ == "__main__":
    main()
