"""Shared test set-up: every test gets its own node-discovery directory and storage."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_outlast_home(tmp_path_factory, monkeypatch):
    # A test must never pick up a node that someone started with `outlast start`.
    home = tmp_path_factory.mktemp("outlast_home")
    monkeypatch.setenv("OUTLAST_HOME", str(home))
    monkeypatch.delenv("OUTLAST_ADDRESS", raising=False)
    # Nodes the tests start preload nothing unless a test asks (outlast/client/preload.py): most
    # test loops never import torch, and a fork server importing it costs seconds of a shared CPU.
    monkeypatch.setenv("OUTLAST_PRELOAD", "")
    yield home


def _standby_vars() -> tuple[str, str]:
    from outlast.agent import forkserver
    from outlast.client import embedded

    return forkserver.STANDBY_VAR, embedded.STANDBY_VAR


@pytest.fixture(scope="session", autouse=True)
def _no_standbys():
    """Nodes the tests start keep no standby fork server and drivers no standby agent, unless a test asks
    (`standbys`). A standby imports what its server imports (torch, for a TorchTrainer's node: 5 s of CPU),
    once per node, and most tests start a node of their own for a run of seconds that no standby ever
    serves: with them, fork servers were the suite's largest use of its two cores. Session-wide, so that
    module-scoped fixtures' runs keep none either; test_standbys.py and test_fork_server_end.py test them."""
    with pytest.MonkeyPatch.context() as mp:
        for name in _standby_vars():
            mp.setenv(name, "0")
        yield


@pytest.fixture
def standbys(monkeypatch):
    """A standby fork server beside every node's server, and a standby agent beside a driver's node: as
    outside the tests."""
    for name in _standby_vars():
        monkeypatch.setenv(name, "1")


@pytest.fixture
def storage_path(tmp_path):
    path = tmp_path / "storage"
    path.mkdir()
    return str(path)


@pytest.fixture
def s3(monkeypatch):
    """The tests' S3-protocol server (moto) on loopback, with a bucket `runs`; what the test starts after
    this (workers, a dashboard) reaches it through the same environment."""
    import socket

    import boto3
    import requests
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    # moto keeps its buckets in the process, not in the server: without a reset a test would find the runs an
    # earlier test left under the same names (and "resume" a finished one).
    requests.post(f"{endpoint}/moto-api/reset", timeout=30).raise_for_status()
    for key, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="runs")
    yield server
    server.stop()


def pytest_collection_modifyitems(config, items):
    try:
        import torch  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="torch is not installed (pip install 'outlast[torch]')")
        for item in items:
            if "torch" in item.keywords:
                item.add_marker(skip)


def pytest_collection_finish(session):
    """The guest kernel's tier takes minutes on a core of its own: start it now, beside the rest."""
    from tests.kernel import guest_tier

    if not session.config.option.collectonly and any(item.nodeid == guest_tier.TEST_ID for item in session.items):
        from tests.kernel.test_cgroup_v2_guest import why_not

        if why_not() is None:
            guest_tier.start()


def pytest_sessionfinish(session):
    from tests.kernel import guest_tier

    guest_tier.stop()
