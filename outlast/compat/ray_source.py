"""Ray's own source, from its wheel, for the parity table and the compatibility suite.

`pip download ray==VERSION --no-deps` fetches the wheel once into a cache outside the
repository (OUTLAST_RAY_WHEEL_CACHE, default ~/.cache/outlast/ray); the Python files under
ray/train and ray/air are unpacked beside it. Nothing of Ray is installed or imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from outlast.compat.ray_alias import RAY_VERSION

_PARTS = ("ray/train/", "ray/air/")


def cache_dir() -> Path:
    return Path(os.environ.get("OUTLAST_RAY_WHEEL_CACHE", "~/.cache/outlast/ray")).expanduser()


def ray_source(version: str = RAY_VERSION) -> Path:
    """The directory that holds `ray/train/...` of Ray `version`, fetching the wheel if need be."""
    from filelock import FileLock

    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    src = root / f"src-{version}"
    with FileLock(str(root / ".lock")):
        if (src / ".complete").exists():
            return src
        wheels = sorted(root.glob(f"ray-{version}-*.whl"))
        if not wheels:
            cmd = [sys.executable, "-m", "pip", "download", f"ray=={version}", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-q", "-d", str(root)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            wheels = sorted(root.glob(f"ray-{version}-*.whl"))
            if done.returncode != 0 or not wheels:
                raise RuntimeError(f"could not fetch Ray {version}'s wheel with `{' '.join(cmd)}`: {done.stderr.strip()}"
                                   f"\nPut the wheel in {root} (or set OUTLAST_RAY_WHEEL_CACHE) and run again.")
        with zipfile.ZipFile(wheels[0]) as z:
            for name in z.namelist():
                if name.startswith(_PARTS) and name.endswith(".py"):
                    z.extract(name, src)
        (src / ".complete").write_text(wheels[0].name)
    return src


def docstring_examples(source: Path, name: str) -> list[tuple[str, bool]]:
    """The `.. testcode::` blocks of the docstring of `name` (a class or function of the file `source`),
    each as (code, whether Ray's own doc build skips it: `:skipif: True`)."""
    import ast
    import textwrap

    tree = ast.parse(source.read_text())
    node = next((n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name),
                None)
    if node is None:
        raise LookupError(f"{source} defines no {name}")
    blocks: list[tuple[str, bool]] = []
    lines = (ast.get_docstring(node) or "").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != ".. testcode::":
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        i += 1
        skipped = False
        while i < len(lines) and lines[i].strip().startswith(":"):  # the directive's options
            skipped |= lines[i].strip().replace(" ", "") == ":skipif:True"
            i += 1
        body = []
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i])
            i += 1
        blocks.append((textwrap.dedent("\n".join(body)).strip() + "\n", skipped))
    return blocks
