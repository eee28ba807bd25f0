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
