"""What `outlast dashboard` refuses, and how it says so: paths outside the run directories, requests
without the token off loopback, a storage path that does not exist, a run written by a newer outlast,
and a store that does not answer. Each answer is a page or a document that says what is wrong,
never a traceback."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from outlast.storage.local import LocalStorage
from outlast.storage.records import RunState, encode
from outlast.storage.run_store import RunStore
from tests.browser.server import ROOT

SECRET = "the contents of a file beside the runs"


def _raw(d, path: str, headers: dict | None = None) -> tuple[int, str, dict]:
    """The request exactly as written: no client normalizes the path first."""
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", (headers or {}).pop("Host", f"127.0.0.1:{d.port}"))
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace"), dict(r.getheaders())
    finally:
        conn.close()


def _log_dir() -> Path:
    """This machine's node log directory, where the agent writes each rank's output (tests set $OUTLAST_HOME)."""
    return Path(os.environ["OUTLAST_HOME"]) / "logs"


def _run_naming(storage: Path, name: str, *paths: str) -> None:
    """A run whose history names `paths` as ranks 0, 1, ...'s output of attempt 1."""
    from outlast.storage.records import AttemptRecord, OutputFile

    state = RunState(name=name, status="finished", created_at=1.0, updated_at=2.0, attempts=[AttemptRecord(
        attempt=1, started_at=1.0, ended_at=2.0, outcome="finished",
        outputs=[OutputFile(rank=r, node_id="n", path=p) for r, p in enumerate(paths)])])
    RunStore(LocalStorage(str(storage)), name).save_state(state)


@pytest.fixture
def runs(tmp_path) -> Path:
    """A storage directory with one run (and the output file its history names, in this machine's log
    directory, where the agent writes it), beside a secret file."""
    storage = tmp_path / "storage"
    logs = _log_dir() / "run-0a1b"
    logs.mkdir(parents=True)
    (logs / "attempt1-rank0.log").write_text("rank 0 step 1\nrank 0 step 2\n")
    (logs / "other.log").write_text(SECRET)
    (tmp_path / "secret.txt").write_text(SECRET)
    _run_naming(storage, "run", str(logs / "attempt1-rank0.log"))
    return storage


def test_nothing_outside_the_run_directories_and_the_files_their_histories_name_is_served(dashboard, runs):
    d = dashboard(str(runs))
    status, body, _ = _raw(d, "/api/runs/0/run/logs/0?attempt=1")
    assert status == 200 and json.loads(body)["lines"] == ["rank 0 step 1", "rank 0 step 2"]
    for path in ["/static/../secret.txt", "/static/..%2f..%2fsecret.txt", "/static/%2e%2e/%2e%2e/secret.txt",
                 "/static/..%2F..%2F..%2Fsecret.txt", "/api/runs/0/..%2Fsecret.txt", "/api/runs/0/..",
                 "/api/runs/0/..%2F..%2Fsecret.txt/logs/0", "/api/runs/0/run/checkpoints/..%2F..%2Fsecret.txt",
                 "/api/runs/0/run/checkpoints/..%2Frun_state.json", "/api/runs/0/run/logs/1",
                 "/api/runs/0/run/logs/0?attempt=2", "/api/runs/0/run/logs/..%2Fother.log",
                 "/runs/0/..%2F..%2Fsecret.txt", "/api/runs/1/run", "/api/runs/-1/run", "/static/",
                 f"/static/{'..%2F' * 12}etc%2Fpasswd", "//etc/passwd", "/api/runs/0/%00"]:
        status, body, _ = _raw(d, path)
        assert status in (400, 404), (path, status, body)
        assert SECRET not in body and "root:" not in body and "Traceback" not in body, path
    # Another Host header on loopback (a page elsewhere rebinding its name to 127.0.0.1) is refused.
    status, _, _ = _raw(d, "/api/runs", {"Host": "attacker.example"})
    assert status == 400


def test_a_history_naming_a_file_outlast_did_not_write_gets_an_error_and_no_byte_of_it(dashboard, runs, tmp_path):
    # Whoever can write the storage path writes the histories: a history is data, not a list of files.
    logs = _log_dir()
    secret = tmp_path / "secret.txt"
    hostname = Path("/etc/hostname").read_text().strip() if Path("/etc/hostname").exists() else ""
    (logs / "linked-1").mkdir()
    (logs / "linked-1" / "attempt1-rank0.log").symlink_to(secret)  # a link in the log directory, pointing out
    outside = tmp_path / "elsewhere" / "linkdir-2"
    outside.mkdir(parents=True)
    (outside / "attempt1-rank0.log").write_text(SECRET)
    (logs / "linkdir-2").symlink_to(outside)  # a linked directory
    _run_naming(runs, "etc", "/etc/hostname")
    _run_naming(runs, "dotdot", f"{logs}/dotdot-1/../../../../{secret}",
                f"{logs}/dotdot-1/attempt1-rank1.log/../../../secret.txt")
    _run_naming(runs, "shaped", f"{tmp_path}/logs/shaped-1/attempt1-rank0.log")  # outlast's shape, elsewhere
    (tmp_path / "logs" / "shaped-1").mkdir(parents=True)
    (tmp_path / "logs" / "shaped-1" / "attempt1-rank0.log").write_text(SECRET)
    _run_naming(runs, "linked", str(logs / "linked-1" / "attempt1-rank0.log"))
    _run_naming(runs, "linkdir", str(logs / "linkdir-2" / "attempt1-rank0.log"))
    _run_naming(runs, "other", str(logs / "run-0a1b" / "other.log"))  # in the log directory, not a rank's file
    d = dashboard(str(runs))
    for run, rank in [("etc", 0), ("dotdot", 0), ("dotdot", 1), ("shaped", 0), ("linked", 0), ("linkdir", 0),
                      ("other", 0)]:
        status, body, _ = _raw(d, f"/api/runs/0/{run}/logs/{rank}?attempt=1")
        error = json.loads(body)["error"]
        assert status in (422, 503), (run, status, body)
        assert SECRET not in body and (not hostname or hostname not in body.replace("/etc/hostname", "")), run
        assert ("is not a file outlast writes" in error or "links are not followed" in error
                or "not on this machine nor could be asked of its node" in error), (run, error)
    status, body, _ = _raw(d, "/api/runs/0/run/logs/0?attempt=1")  # a real rank's output is still served
    assert status == 200 and json.loads(body)["lines"] == ["rank 0 step 1", "rank 0 step 2"]
    # `outlast runs --logs` reads histories the same way.
    for run, said in [("etc", "is not a file outlast writes"), ("linked", "links are not followed")]:
        cli = subprocess.run([sys.executable, "-m", "outlast.cli.main", "runs", str(runs), run, "--logs", "0"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert cli.returncode == 1 and said in cli.stderr and SECRET not in cli.stdout, cli
        assert not hostname or hostname not in cli.stdout


def _wrong(token: str) -> str:
    """The token with its last character changed: a token that ends in "x" must not be sent back as its own."""
    return token[:-1] + ("y" if token.endswith("x") else "x")


def test_off_loopback_every_request_needs_the_token_printed_at_start(dashboard, runs):
    d = dashboard(str(runs), host="0.0.0.0")
    assert "?token=" in d.banner
    token = d.banner.split("?token=")[1].split()[0]
    for path in ["/runs", "/api/runs", "/static/app.js", "/api/runs/0/run"]:
        status, body, _ = _raw(d, path)
        assert status == 401 and "token" in body, path
        status, _, _ = _raw(d, f"{path}{'&' if '?' in path else '?'}token={_wrong(token)}")
        assert status == 401, path
    status, body, headers = _raw(d, f"/api/runs?token={token}")
    assert status == 200 and json.loads(body)["paths"][0]["runs"][0]["name"] == "run"
    cookie = headers["set-cookie"].split(";")[0]
    status, _, _ = _raw(d, "/api/runs/0/run", {"Cookie": cookie})
    assert status == 200
    status, _, _ = _raw(d, "/api/runs/0/run", {"Authorization": f"Bearer {token}"})
    assert status == 200


def test_a_missing_storage_path_a_newer_run_and_an_unknown_run_get_a_clear_answer(dashboard, runs, tmp_path):
    newer = runs / "newer"
    newer.mkdir()
    (newer / "run_state.json").write_text(json.dumps({"version": 99, "name": "newer", "status": "running"}))
    d = dashboard(str(runs), str(tmp_path / "nowhere"))
    listing = json.loads(_raw(d, "/api/runs")[1])["paths"]
    unreadable = {r["name"]: r.get("unreadable") for r in listing[0]["runs"]}["newer"]
    assert "newer/run_state.json has schema version 99" in unreadable and "upgrade outlast" in unreadable
    assert "does not exist on this machine" in listing[1]["error"]
    status, body, _ = _raw(d, "/api/runs/0/newer")
    assert status == 422 and json.loads(body)["error"] == unreadable
    status, body, _ = _raw(d, "/runs/1/anything")  # a page: the shell, which shows what the API says
    assert status == 200
    status, body, _ = _raw(d, "/api/runs/1/anything")
    assert status == 404 and "does not exist on this machine" in json.loads(body)["error"]
    status, body, _ = _raw(d, "/api/runs/0/nope")
    assert status == 404 and "there is no run named 'nope'" in json.loads(body)["error"]
    status, body, _ = _raw(d, "/no/such/page")
    assert status == 404 and "there is no such page here" in body and "Traceback" not in body
    status, body, _ = _raw(d, "/api/runs/0/run/logs/0?lines=x")
    assert status == 400 and "lines must be a whole number" in json.loads(body)["error"]


def test_a_store_that_does_not_answer_is_a_page_that_says_so(dashboard, monkeypatch):
    silent = socket.socket()  # accepts connections into its backlog and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    try:
        port = silent.getsockname()[1]
        for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        d = dashboard("s3://runs/x", "--timeout", "2")
        status, body, _ = _raw(d, "/api/runs")
        (entry,) = json.loads(body)["paths"]
        assert status == 200 and "the store at s3://runs/x did not answer within 2 s" in entry["error"]
        status, body, _ = _raw(d, "/api/runs/0/run")
        assert status == 503 and "did not answer within 2 s" in json.loads(body)["error"]
    finally:
        silent.close()


def test_the_dashboard_refuses_a_port_it_cannot_have_and_says_so(runs):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        out = subprocess.run([sys.executable, "-m", "outlast.cli.main", "dashboard", str(runs), "--port",
                              str(taken.getsockname()[1])], cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert out.returncode == 1 and "could not listen on 127.0.0.1" in out.stderr and "Traceback" not in out.stderr


def test_in_the_browser_bad_input_is_a_page_that_says_what_is_wrong(dashboard, page, runs, tmp_path):
    from tests.browser.conftest import shoot

    d = dashboard(str(tmp_path / "nowhere"), str(runs))
    page.goto(f"{d.url}/runs/0/anything")
    page.wait_for_selector("#error")
    assert "does not exist on this machine" in page.inner_text("#error")
    page.goto(f"{d.url}/runs")
    page.wait_for_selector("tr[data-run=run]")
    assert "does not exist on this machine" in page.inner_text(".error-box")
    shoot(page, "runs-page-missing-path")
    page.goto(f"{d.url}/cluster")
    page.wait_for_selector("#error")
    assert "no outlast node runs on this machine" in page.inner_text("#error")
    page.goto(f"{d.url}/no/such/page")
    assert "there is no such page here" in page.inner_text("#error")
    assert "Traceback" not in page.content()


def test_a_document_over_the_size_limit_is_refused_saying_which_and_the_rest_still_works(dashboard, runs, tmp_path):
    from outlast.cli.dashboard.bounded import MAX_DOCUMENT_BYTES
    from outlast.storage.records import MANIFEST_NAME, CheckpointRecord, Manifest

    big = RunState(name="big", status="errored", created_at=1.0, updated_at=2.0, error="x" * MAX_DOCUMENT_BYTES)
    RunStore(LocalStorage(str(runs)), "big").save_state(big)
    store = RunStore(LocalStorage(str(runs)), "bigmanifest")
    store.save_state(RunState(name="bigmanifest", status="finished", created_at=1.0, updated_at=2.0,
                              checkpoints=[CheckpointRecord(checkpoint_dir="checkpoint_000001", seq=1, attempt=1,
                                                            report_index=0, committed_at=2.0)]))
    (runs / "bigmanifest" / "checkpoint_000001").mkdir()
    (runs / "bigmanifest" / "checkpoint_000001" / MANIFEST_NAME).write_bytes(
        encode(Manifest(checkpoint_dir="checkpoint_000001", seq=1, attempt=1, report_index=0, committed_at=2.0,
                        ranks=[0], files=[])) + b" " * MAX_DOCUMENT_BYTES)
    (runs / "linked").mkdir()
    (runs / "linked" / "run_state.json").symlink_to(tmp_path / "secret.txt")
    d = dashboard(str(runs))
    listed = {r["name"]: r for r in json.loads(_raw(d, "/api/runs")[1])["paths"][0]["runs"]}
    size = (runs / "big" / "run_state.json").stat().st_size
    assert f"big/run_state.json is {size:,} bytes, more than the dashboard reads of one document " \
           f"({MAX_DOCUMENT_BYTES} bytes)" in listed["big"]["unreadable"]
    assert "links are not followed" in listed["linked"]["unreadable"] and listed["run"]["status"] == "finished"
    status, body, _ = _raw(d, "/api/runs/0/big")
    assert status == 422 and json.loads(body)["error"] == listed["big"]["unreadable"] and len(body) < 10_000
    status, body, _ = _raw(d, "/api/runs/0/bigmanifest/checkpoints/checkpoint_000001")
    assert status == 422 and f"{MANIFEST_NAME} is" in json.loads(body)["error"] and len(body) < 10_000
    status, body, _ = _raw(d, "/api/runs/0/linked")
    assert status == 422 and SECRET not in body
    assert _raw(d, "/api/runs/0/run")[0] == 200  # the rest goes on


def test_numbers_and_names_in_urls_are_checked_before_anything_is_read(dashboard, runs):
    d = dashboard(str(runs))
    for path, status, said in [
            ("/api/runs/%D9%A1/run", 404, "is not a storage path's number"),  # an Arabic-Indic 1, which int() takes
            ("/api/runs/0_0/run", 404, "is not a storage path's number"),
            (f"/api/runs/{'9' * 5000}/run", 404, "is not a storage path's number"),
            (f"/api/runs/0/run/logs/{'9' * 5000}", 404, "is not a rank's number"),
            ("/api/runs/0/run/logs/0?attempt=%201", 400, "attempt must be a whole number"),
            (f"/api/runs/0/run/logs/0?lines={'9' * 5000}", 400, "lines must be a whole number"),
            (f"/api/runs/0/{'n' * 300}", 404, "is not a run's name"),
            ("/api/runs/0/%2E%2E", 404, "is not a run's name"),
            (f"/api/runs/0/{'a' * 9000}/", 414, "more than the dashboard takes (8192)")]:  # no redirect echoing it
        got, body, _ = _raw(d, path)
        assert got == status and said in json.loads(body)["error"], (path, got, body[:300])


def _watch(page) -> list[str]:
    """Every console error, failed request and answer of 400 or more the page meets, as it meets it."""
    seen: list[str] = []
    page.on("console", lambda m: seen.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("requestfailed", lambda r: seen.append(f"failed: {r.url} {r.failure}"))
    page.on("response", lambda r: seen.append(f"{r.status}: {r.url}") if r.status >= 400 else None)
    return seen


def test_in_the_browser_without_the_token_a_plain_page_says_what_is_wrong_and_how_to_get_in(dashboard, page, runs):
    d = dashboard(str(runs), host="0.0.0.0")
    token = d.banner.split("?token=")[1].split()[0]
    url = f"http://127.0.0.1:{d.port}"
    page.goto(f"{url}/runs")
    text = page.inner_text("body")
    assert "needs the token it printed when it started" in text and "loading" not in text
    assert "open the URL that outlast dashboard printed" in text and f"{url}/runs?token=…" in text
    page.goto(f"{url}/runs/0/run?token={_wrong(token)}")
    assert "the token in this address is not this dashboard's" in page.inner_text("#locked")
    page.context.clear_cookies()
    seen = _watch(page)
    page.goto(f"{url}/runs?token={token}")
    page.wait_for_selector("tr[data-run=run]")
    page.goto(f"{url}/runs/0/run")  # the cookie the first answer set lets the next pages in
    page.wait_for_selector("#run-head")
    assert seen == [] and page.js_errors == []


def test_in_the_browser_a_page_loads_with_no_console_error_and_no_failed_request(dashboard, page, runs):
    d = dashboard(str(runs))
    seen = _watch(page)
    page.goto(f"{d.url}/runs")
    page.wait_for_selector("tr[data-run=run]")
    # The page names its icon, so the browser asks for that one (and never for /favicon.ico).
    assert page.get_attribute("link[rel=icon]", "href") == "/static/favicon.svg"
    page.goto(f"{d.url}/runs/0/run")
    page.wait_for_selector("#run-head")
    page.wait_for_load_state("networkidle")  # the icon is asked for after the load
    assert seen == [] and page.js_errors == [], seen
    status, body, headers = _raw(d, "/favicon.ico")  # where a client asks when a page names no icon
    assert status == 200 and headers["content-type"] == "image/svg+xml" and body.startswith("<svg")
