"""The dashboard stays behind its extra: `pip install outlast` pulls no web server, the CLI imports
none until `outlast dashboard` runs, and the wheel carries every asset the pages load."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "outlast" / "cli" / "dashboard" / "static"


def test_the_cli_imports_no_web_server_until_the_dashboard_runs():
    out = subprocess.run([sys.executable, "-c", "import sys, outlast.cli.main, outlast.train; "
                          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'uvicorn')))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_every_asset_a_page_loads_is_in_the_package_and_none_comes_from_elsewhere():
    shell = (STATIC / "page.html").read_text()
    for asset in ("uPlot.iife.min.js", "uPlot.min.css", "app.js", "run.js", "style.css"):
        assert f"/static/{asset}" in shell and (STATIC / asset).stat().st_size > 0
    for text in (shell, *((STATIC / f).read_text() for f in ("app.js", "run.js", "style.css"))):
        assert "http://" not in text.replace('"http://www.w3.org/2000/svg"', "") and "https://" not in text
    assert "MIT License" in (STATIC / "uPlot.LICENSE").read_text()


@pytest.mark.timeout(300)
def test_the_wheel_carries_the_static_files_and_the_server_only_under_the_extra(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(ROOT),
                            "-w", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("outlast-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for asset in ("page.html", "app.js", "run.js", "style.css", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE"):
        assert f"outlast/cli/dashboard/static/{asset}" in names
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    server = [line for line in requires if "starlette" in line or "uvicorn" in line]
    assert server and all("extra ==" in line for line in server)
    assert any('extra == "dashboard"' in line for line in server)
