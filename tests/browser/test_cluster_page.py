"""The cluster page in a real browser: the node table of a LocalCluster, and a drain that
`outlast drain-node` starts shown with its reason and a countdown to its deadline, without a reload."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

from outlast.testing import LocalCluster
from outlast.train import RunConfig, ScalingConfig, Trainer
from tests.browser.conftest import shoot
from tests.browser.loops import charted_loop
from tests.browser.server import ROOT


def _left(page, node: str) -> int:
    text = page.inner_text(f"tr[data-node={node}] .countdown")
    found = re.fullmatch(r"deadline in (\d+) s", text)
    assert found, text
    return int(found.group(1))


def test_the_cluster_page_counts_down_a_drain_started_from_the_cli(dashboard, page, storage_path, tmp_path):
    with LocalCluster(num_nodes=2, cpus_per_node=1):
        run = threading.Thread(target=lambda: Trainer(
            charted_loop, train_loop_config={"events": str(tmp_path / "events.jsonl"), "steps": 200,
                                             "step_sleep": 0.05, "every": 50},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="held", storage_path=storage_path)).fit(), daemon=True)
        d = dashboard()
        page.goto(f"{d.url}/cluster")
        page.wait_for_selector("tr[data-node=node-1][data-state=alive]")
        assert page.locator("table.nodes tr[data-node]").count() == 2
        run.start()
        page.evaluate("() => { window.notReloaded = true; }")
        # Each node holds one worker's CPU for the run while it trains, and shows that worker.
        page.wait_for_function("() => [...document.querySelectorAll('tr[data-node] td.held')].every("
                               "td => td.textContent.includes('CPU 1'))", timeout=120_000)
        assert page.locator("tr[data-node] td.workers div").count() == 2
        shoot(page, "cluster-page-held")
        run.join(timeout=300)
        assert not run.is_alive()
        done = subprocess.run([sys.executable, "-m", "outlast.cli.main", "drain-node", "--node-id", "node-1",
                               "--reason", "maintenance", "--reason-message", "kernel upgrade",
                               "--deadline-remaining-seconds", "600"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        page.wait_for_selector("tr[data-node=node-1][data-state=draining] .countdown", timeout=30_000)
        assert "maintenance: kernel upgrade" in page.inner_text("tr[data-node=node-1] .why")
        first = _left(page, "node-1")
        assert 540 <= first <= 600
        page.wait_for_function(f"() => document.querySelector('tr[data-node=node-1] .countdown').textContent "
                               f"!== 'deadline in {first} s'", timeout=10_000)
        assert _left(page, "node-1") < first
        assert page.evaluate("() => window.notReloaded") is True
        assert page.locator("tr[data-node=node-0][data-state=alive]").count() == 1
        assert page.js_errors == []
        shoot(page, "cluster-page-drain")
