"""The dashboard's tests drive a real browser: Debian's chromium (scripts/setup-browser), headless,
through Playwright; the dashboard itself runs as `outlast dashboard`, a process of its own.

Each test keeps a screenshot under tests/artifacts/ (printed as it is written)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.browser.server import Dashboard

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = os.environ.get("OUTLAST_TEST_CHROMIUM", "/usr/bin/chromium")
# Background networking off: the browser reaches nothing but the dashboard.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM} (scripts/setup-browser installs Debian's)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    with sync_playwright() as p:
        # launch() gives the browser a fresh profile of its own, removed when it closes.
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.js_errors = errors
    yield p
    context.close()


def shoot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


@pytest.fixture
def dashboard():
    started: list[Dashboard] = []

    def start(*args: str, **kw) -> Dashboard:
        started.append(Dashboard(*args, **kw))
        return started[-1]

    yield start
    for d in started:
        d.stop()
