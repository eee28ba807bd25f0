"""Generated requests to every route of a real `outlast dashboard`, over a storage directory of
hostile documents (tests/browser/dashboard_fuzz.py), on loopback and behind its token. After each,
the dashboard is still up and answers a valid request whole; no answer is a 500 or carries a
traceback, and none carries a byte of the canary file outside the storage and log directories.

A small count here; bench/fuzz_dashboard.py runs 100,000 and more."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from tests.browser.dashboard_fuzz import (HOSTILE_SEGMENTS, QUERY_KEYS, RAW_BYTES, ROUTES, Probe,  # noqa: E402
                                          hostile_storage)


def _segments(names: list[str], checkpoints: list[str]) -> st.SearchStrategy[str]:
    text = st.text(st.characters(codec="utf-8"), max_size=20).map(lambda t: quote(t, safe=".%~"))
    return st.one_of(st.sampled_from([quote(n, safe="") for n in names + checkpoints]),
                     st.sampled_from(HOSTILE_SEGMENTS), text)


@st.composite
def _requests(draw, names: list[str], checkpoints: list[str]) -> tuple[int, bytes, dict]:
    seg = _segments(names, checkpoints)
    i, name, number, ckpt = draw(st.sampled_from(["0", "1", "-1", "00"]) | seg), draw(seg), draw(
        st.sampled_from(["0", "1", "7"]) | seg), draw(seg)
    path = draw(st.sampled_from([
        "/", "/runs", "/cluster", "/favicon.ico", f"/runs/{i}/{name}", "/api/runs", "/api/cluster",
        f"/api/runs/{i}/{name}", f"/api/runs/{i}/{name}/checkpoints/{ckpt}", f"/api/runs/{i}/{name}/logs/{number}",
        f"/static/{name}", "/" + "/".join(draw(st.lists(seg, max_size=5)))]))
    query = draw(st.lists(st.tuples(st.sampled_from(QUERY_KEYS), seg | st.sampled_from(["1", "0", "", "-1", "100001"])),
                          max_size=3))
    raw = (path + ("?" + "&".join(f"{k}={v}" for k, v in query) if query else "")).encode()
    raw += draw(st.sampled_from([b""] * 10 + RAW_BYTES))
    headers = draw(st.sampled_from([{}, {"Cookie": "outlast_dashboard_token=wrong"}, {"Host": "attacker.example"},
                                    {"Authorization": "Bearer " + "x" * 5000}, {"Cookie": "=" * 100}]))
    return draw(st.integers(0, 1)), raw, headers


def test_generated_requests_to_every_route_never_crash_leak_a_file_or_stop_the_dashboard(tmp_path, dashboard):
    log_dir = Path(os.environ["OUTLAST_HOME"]) / "logs"
    storage = hostile_storage(tmp_path, log_dir)
    plain = dashboard(str(storage.root), env={"OUTLAST_ADDRESS": ""})
    gated = dashboard(str(storage.root), host="0.0.0.0", env={"OUTLAST_ADDRESS": ""})
    token = gated.banner.split("?token=")[1].split()[0]
    probes = [Probe(plain.port, storage), Probe(gated.port, storage, token=token)]

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(_requests(storage.names, storage.checkpoints))
    def one(request: tuple[int, bytes, dict]) -> None:
        which, raw, headers = request
        probe = probes[which]
        if which == 1 and "Authorization" not in headers and "Cookie" not in headers:
            headers = {**headers, "Authorization": f"Bearer {token}"}  # mostly through the gate, to the routes
        before = len(probe.verdict.problems)
        probe.judge(raw, headers)
        probe.alive()
        assert probe.verdict.problems[before:] == []

    try:
        one()
    finally:
        for p in probes:
            p.close()
    assert plain.proc.poll() is None and gated.proc.poll() is None
    assert sum(p.verdict.requests for p in probes) >= 150
    assert sum(p.verdict.by_status[200] for p in probes) > 0  # the routes were reached, not only refused
    assert [r for r in ROUTES if not sum(p.verdict.by_route[r] for p in probes)] == []  # every one of them
