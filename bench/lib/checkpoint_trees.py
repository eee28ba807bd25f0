"""What the checkpoint benchmarks (bench/checkpoint.py, bench/memory_tier.py) share: trees of
incompressible bytes, one timed move of a tree in a fresh process (bench/lib/checkpoint_probe.py, in
the Python of the method's framework), and the versions of what those processes run."""

import json
import os
import subprocess

from bench.lib.venvs import OUTLAST_PY, RAY_PY, ROOT, module

MB = 2**20


def make_tree(path, total_mb, file_mb):
    os.makedirs(path)
    for i in range(max(total_mb // file_mb, 1)):
        with open(os.path.join(path, f"part-{i:04d}.bin"), "wb") as f:
            for _ in range(file_mb):
                f.write(os.urandom(MB))


def probe(method, op, src, dest, into, env, workdir, errors):
    """bench/lib/checkpoint_probe.py's figures ({"s", "bytes", ...}), or None (see run_probe)."""
    python = RAY_PY if method.endswith("ray") or method == "ray_report" else OUTLAST_PY
    return run_probe(module(python, "bench.lib.checkpoint_probe", "--method", method, "--op", op, "--src", src,
                            "--dest", dest, "--into", into),
                     env, f"{method} {op} -> {dest}", errors, log=os.path.join(workdir, "probe.log"))


def run_probe(cmd, env, what, errors, log=None):
    """Runs a probe from the repository root: the JSON document on its last line; None when it failed,
    with `what` and why added to `errors` (its output appended to `log`, when given)."""
    try:
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if log:
            with open(log, "a") as f:
                f.write(f"== {what}\n{r.stdout}{r.stderr}")
        if r.returncode != 0:
            raise RuntimeError(f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, RuntimeError) as e:
        errors.append(f"{what}: {e}" + (f", see {log}" if log else ""))
        return None


def versions():
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in %r}))")
    out = {}
    for py, pkgs in ((OUTLAST_PY, ["outlast", "torch", "xxhash", "fsspec", "s3fs", "moto"]),
                     (RAY_PY, ["ray", "torch", "pyarrow"])):
        try:
            r = subprocess.run([py, "-c", code % pkgs], capture_output=True, text=True, timeout=120, check=True)
            out.update({("ray venv " + k if py == RAY_PY else k): v for k, v in json.loads(r.stdout).items()})
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            out[py] = f"unknown ({e})"
    return out
