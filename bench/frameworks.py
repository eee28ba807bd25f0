"""Wall time of Ray Train framework examples, unchanged, on Ray 2.60 and on outlast, in the same run.

    python3 -m bench.frameworks [--repeats 3] [--ray-python bench/.ray-venv/bin/python]

The examples: the XGBoostTrainer example of Ray's own docstring (from the Ray 2.60.0 wheel), and Lightning,
Transformers and JAX scripts in the shape of Ray's guides (bench/framework_examples/, tiny models,
synthetic data). Each repeat runs every example once on each side, alternating which goes first; a
side's time is the whole process, so Ray's includes starting Ray and outlast's starting its node.
Prints one JSON document: per example, each side's median and range, and outlast / Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.lib.harness import load, machine, ratio, summary
from bench.lib.venvs import BENCH, RAY_PY


def _xgboost_docstring_example(tmp: str) -> str:
    from outlast.compat.ray_source import docstring_examples, ray_source

    code, _ = docstring_examples(ray_source() / "ray/train/v2/xgboost/xgboost_trainer.py", "XGBoostTrainer")[0]
    path = os.path.join(tmp, "xgboost_docstring_example.py")
    with open(path, "w") as f:
        f.write(code)
    return path


def _examples(tmp: str) -> dict[str, str]:
    own = os.path.join(BENCH, "framework_examples")
    return {"xgboost (Ray's XGBoostTrainer docstring)": _xgboost_docstring_example(tmp),
            "lightning": os.path.join(own, "lightning_example.py"),
            "transformers": os.path.join(own, "transformers_example.py"),
            "jax": os.path.join(own, "jax_example.py")}


def _run(cmd: list[str], home: str) -> float | None:
    print(f"[bench] {' '.join(cmd)}", file=sys.stderr, flush=True)
    env = {**os.environ, "HOME": home, "OUTLAST_STORAGE_PATH": os.path.join(home, "outlast_results"),
           "PYTHONDONTWRITEBYTECODE": "1", "RAY_TRAIN_V2_ENABLED": "1"}
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=home, env=env)
    took = time.monotonic() - started
    if done.returncode != 0:
        print(f"[bench] exit {done.returncode}: {done.stderr[-3000:]}", file=sys.stderr, flush=True)
        return None
    return took


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ray-python", default=RAY_PY)
    p.add_argument("--only", action="append", help="run only the examples whose name starts with this")
    args = p.parse_args()
    load_before = load()
    with tempfile.TemporaryDirectory() as tmp:
        examples = {k: v for k, v in _examples(tmp).items()
                    if not args.only or any(k.startswith(o) for o in args.only)}
        times: dict[str, dict[str, list]] = {name: {"ray": [], "outlast": []} for name in examples}
        for i in range(args.repeats):
            for name, script in examples.items():
                sides = [("ray", [args.ray_python, script]),
                         ("outlast", [sys.executable, "-m", "outlast.cli.main", "run", script])]
                for side, cmd in (sides if i % 2 == 0 else sides[::-1]):
                    home = tempfile.mkdtemp(dir=tmp)
                    times[name][side].append(_run([*cmd, os.path.join(home, "storage")], home))
    figures = {}
    for name, t in times.items():
        ray_s, outlast_s = summary(t["ray"]), summary(t["outlast"])
        figures[name] = {"wall_s": {"ray": ray_s, "outlast": outlast_s},
                         "outlast_over_ray": None if ratio(outlast_s, ray_s) is None
                         else round(ratio(outlast_s, ray_s), 3)}
    versions = {}
    for mod in ("lightning", "transformers", "xgboost", "jax", "torch"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    print(json.dumps({"benchmark": "frameworks", "repeats": args.repeats, "examples": figures,
                      "load_before": load_before, "load_after": load(), "machine": machine(versions)}, indent=2))


if __name__ == "__main__":
    main()
