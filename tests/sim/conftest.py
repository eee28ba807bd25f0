"""The simulator's tests run thousands of runs: the controller's logging is silenced for each
test and given back after it, so that later tests' log captures see it."""

from __future__ import annotations

import logging

import pytest

from outlast.sim.run import quiet


@pytest.fixture(autouse=True)
def _quiet():
    logger = logging.getLogger("outlast")
    level = logger.level
    quiet()
    yield
    logger.setLevel(level)
