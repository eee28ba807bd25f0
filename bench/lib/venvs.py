"""The two Pythons the benchmarks run in, and how a benchmark starts a module of bench in either.

outlast's side runs in the project's virtual environment (.venv), Ray's in bench/.ray-venv (made by
bench/setup_ray_venv.sh). A benchmark starts bench's scenarios and probes as modules (`-m`) with the
repository root as working directory, so that `bench`, and `outlast` from a source checkout, import
without a path set by hand; the runs' workers import them the same way (Ray adds the driver's working
directory to its workers' paths, outlast sends its workers the driver's import path).
Standard library only: Ray's side imports it too.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
OUTLAST_VENV = os.path.join(ROOT, ".venv", "bin")
OUTLAST_PY = os.path.join(OUTLAST_VENV, "python")
RAY_VENV = os.path.join(BENCH, ".ray-venv", "bin")
RAY_PY = os.path.join(RAY_VENV, "python")


def module(python: str, name: str, *args: str) -> list[str]:
    """The command that runs module `name` of bench with `python`; run it with cwd=ROOT."""
    return [python, "-m", name, *args]


def with_root(env: dict[str, str]) -> dict[str, str]:
    """`env` with this checkout first on PYTHONPATH: outlast imports from it without being installed."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))}


def ensure_ray_venv() -> None:
    """Makes bench/.ray-venv when it is not there yet (a few minutes; pip's output on stderr)."""
    if not os.path.exists(RAY_PY):
        print("creating bench/.ray-venv (bench/setup_ray_venv.sh)", file=sys.stderr, flush=True)
        subprocess.run(["bash", os.path.join(BENCH, "setup_ray_venv.sh")], check=True, stdout=sys.stderr)


def in_project_venv(main_module: str, *needs: str) -> None:
    """Runs `main_module` again, with the same arguments, in the project's virtual environment when this
    Python cannot import one of `needs` (a system python3 rarely has psutil; .venv has them all)."""
    missing = []
    for name in needs:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if not missing:
        return
    if os.path.exists(OUTLAST_PY) and os.path.realpath(sys.prefix) != os.path.dirname(os.path.realpath(OUTLAST_VENV)):
        os.execv(OUTLAST_PY, [OUTLAST_PY, "-m", main_module, *sys.argv[1:]])
    raise SystemExit(f"{sys.executable} cannot import {', '.join(missing)}: run this benchmark with the project's "
                     f"virtual environment ({OUTLAST_PY}, which scripts/setup makes)")
