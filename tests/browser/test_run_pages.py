"""A run's page in a real browser, against real runs on local storage and on the tests' S3 server:
the attempts, the failure and the drain in their places on the timeline, a chart with every
reported point, the output the CLI shows, and a chart that grows while the run trains."""

from __future__ import annotations

import math
import subprocess
import sys
import threading

import pytest

from outlast.storage import open_storage
from outlast.storage.run_store import RunStore
from outlast.train import RunConfig, ScalingConfig, Trainer
from tests.browser.conftest import shoot
from tests.browser.loops import charted_loop
from tests.browser.scenarios import STEPS, failure_drain_resize
from tests.browser.server import ROOT
from tests.integration.jobs import read_events
from tests.integration.procs import wait_until


def _marks(page, selector: str) -> list[dict]:
    return page.eval_on_selector_all(selector, "els => els.map(e => ({...e.dataset}))")


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_finished_run_shows_its_attempts_failure_drain_resize_and_every_reported_point(
        where, request, tmp_path, dashboard, page):
    storage_path = str(tmp_path / "storage") if where == "local" else "s3://runs/experiments"
    if where == "s3":
        request.getfixturevalue("s3")
    events = tmp_path / "events.jsonl"
    with failure_drain_resize(storage_path, events):
        store = RunStore(open_storage(storage_path), "story")
        state = store.load_state()
        reported = sum(len(store.read_reports(a.attempt)) for a in state.attempts)

        d = dashboard(storage_path)
        page.goto(f"{d.url}/runs")
        page.wait_for_selector("tr[data-run=story]")
        assert page.inner_text("tr[data-run=story] td.attempts") == "3"

        page.click("text=story")
        page.wait_for_selector("#chart canvas")
        attempts = _marks(page, ".tl-attempt")
        assert [(a["attempt"], a["workers"], a["outcome"]) for a in attempts] == [
            ("1", "3", "failed"), ("2", "3", "resized"), ("3", "2", "finished")]
        span = {a["attempt"]: (float(a["x0"]), float(a["x1"])) for a in attempts}

        (root,) = _marks(page, ".tl-failure[data-root='1']")
        assert (root["attempt"], root["rank"]) == ("1", "1")  # the SIGKILL of rank 1 in attempt 1
        assert span["1"][0] <= float(root["x"]) <= span["1"][1] + 1
        assert "killed by SIGKILL" in page.inner_text("#failures-section")

        (drain,) = _marks(page, ".tl-drain")
        assert drain["attempt"] == "2" and span["2"][0] <= float(drain["x0"]) <= span["2"][1] + 1
        assert float(drain["x1"]) > span["3"][1]  # drawn to its deadline, 30 s on, past the run's end

        (resize,) = _marks(page, ".tl-resize")
        assert resize["attempt"] == "3" and span["3"][0] <= float(resize["x"]) <= span["3"][1]  # when it was placed
        assert len(_marks(page, ".tl-checkpoint")) == len(state.checkpoints)
        assert [r["attempt"] for r in _marks(page, ".tl-restore")] == ["2", "3"]

        # The goodput bar beside the timeline: the parts add up to the attempts' held time, and the kill, the drain
        # and the resize each cost their part (outlast/storage/goodput.py).
        held = sum(a.ended_at - a.started_at for a in state.attempts)
        bar = page.locator("#goodput")
        assert math.isclose(float(bar.get_attribute("data-held")), held, rel_tol=1e-6)
        parts = {p["part"]: float(p["seconds"]) for p in _marks(page, "#goodput .gp-part")}
        assert math.isclose(sum(parts.values()), held, rel_tol=1e-6)
        assert parts.get("productive", 0) > 0 and parts.get("restarts", 0) > 0 and parts.get("drains", 0) > 0
        widths = page.eval_on_selector_all("#goodput .gp-part", "els => els.map(e => e.getBoundingClientRect().width)")
        bar_width = page.eval_on_selector("#goodput .gp-bar", "e => e.clientWidth")
        assert abs(sum(widths) - bar_width) <= len(widths)  # the bar drawn whole, each part to its share
        assert "Goodput " in bar.inner_text() and "went into steps that stayed" in bar.inner_text()

        chart = page.locator("#chart")
        assert chart.get_attribute("data-metric") == "loss" and chart.get_attribute("data-attempts") == "1,2,3"
        assert int(chart.get_attribute("data-points")) == reported
        plotted = page.evaluate("() => R.chart.data.slice(1).map(s => s.filter(v => v != null).length)")
        assert sum(plotted) == reported
        # Every step rank 0 finished in the last attempt is a point of it: to the last step.
        last = [e["step"] for e in read_events(events) if e["event"] == "step" and e["attempt"] == 3 and e["rank"] == 0]
        assert last[-1] == STEPS - 1
        xs = page.evaluate("() => R.chart.data[0].filter((x, i) => R.chart.data[3][i] != null)")
        assert xs == last

        page.click(".log-button[data-attempt='1'][data-rank='1']")
        page.wait_for_function("() => document.getElementById('log-title').textContent.startsWith('rank 1, attempt 1')")
        shown = page.inner_text("#log-lines").splitlines()
        cli = subprocess.run([sys.executable, "-m", "outlast.cli.main", "runs", storage_path, "story", "--logs", "1",
                              "--attempt", "1", "--lines", "500"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and shown == cli.stdout.splitlines() and "rank 1 step 7" in shown

        latest = page.locator(f"tr[data-checkpoint={state.latest_checkpoint}]")
        latest.locator("button").click()
        page.wait_for_function(f"() => document.querySelector('tr[data-checkpoint={state.latest_checkpoint}] "
                               f".check').textContent.includes('matches')")
        assert "B in 1 file(s)" in latest.locator(".size").inner_text()
        assert page.js_errors == []
        shoot(page, f"run-page-{where}")


def test_a_run_still_training_grows_its_chart_without_a_reload(tmp_path, dashboard, page, storage_path):
    events = tmp_path / "events.jsonl"
    steps = 300
    run = threading.Thread(target=lambda: Trainer(
        charted_loop, train_loop_config={"events": str(events), "steps": steps, "step_sleep": 0.05, "every": 50},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="live", storage_path=storage_path)).fit(), daemon=True)
    run.start()
    store = RunStore(open_storage(storage_path), "live")
    wait_until(lambda: (s := store.load_state()) is not None and s.attempts and store.read_reports(1), 120,
               "the run's first reports on storage")
    d = dashboard(storage_path)
    page.goto(f"{d.url}/runs/0/live")
    page.wait_for_selector("#chart canvas")
    page.evaluate("() => { window.notReloaded = true; }")
    first = int(page.get_attribute("#chart", "data-points"))
    assert first < steps
    page.wait_for_function(f"() => Number(document.getElementById('chart').dataset.points) >= {first + 20}",
                           timeout=120_000)
    assert page.evaluate("() => window.notReloaded") is True
    shoot(page, "run-page-live")
    run.join(timeout=300)
    assert not run.is_alive()
    page.wait_for_function("() => document.querySelector('#run-head .status').textContent === 'finished'",
                           timeout=60_000)
    page.wait_for_function(f"() => Number(document.getElementById('chart').dataset.points) === {steps}",
                           timeout=30_000)
    assert page.evaluate("() => window.notReloaded") is True
    assert page.js_errors == []
