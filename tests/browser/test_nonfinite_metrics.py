"""A loss that diverges stays on the run's page: NaN and the infinities in the last metrics and the checkpoints'
metrics as the numbers they are, and the chart says which reports it could not draw."""

from __future__ import annotations

from outlast.train import RunConfig, ScalingConfig, Trainer
from tests.browser.conftest import shoot
from tests.integration.bad_input_jobs import diverging_loop


def test_a_diverging_loss_shows_on_the_page_and_the_chart_names_the_points_it_cannot_draw(
        storage_path, dashboard, page):
    Trainer(diverging_loop, scaling_config=ScalingConfig(num_workers=1),
            run_config=RunConfig(name="diverged", storage_path=storage_path)).fit()

    d = dashboard(storage_path)
    page.goto(f"{d.url}/runs/0/diverged")
    page.wait_for_selector("#chart canvas")
    assert "loss=NaN" in page.inner_text("main") and "low=-Infinity" in page.inner_text("main")
    assert page.eval_on_selector("#chart", "e => e.dataset.points") == "1"  # step 0's 1.5, the one finite loss
    note = page.inner_text("#chart-odd")
    assert note == "not drawn, loss was not a finite number: Infinity at step 1, NaN at step 2", note
    shoot(page, "run-diverged")
