"""The dashboard's fuzzer, shared by its test (tests/browser/test_dashboard_fuzz.py, Hypothesis, a
small count) and its benchmark (bench/fuzz_dashboard.py, a seeded generator, 100,000 and more).

`hostile_storage` writes a storage directory of runs whose documents are hostile (garbage, empty,
huge, wrong types, newer and negative versions, deep nesting, a FIFO and a directory in a
document's place, links out, histories naming files elsewhere) beside one good run, and a canary
file outside it whose contents must never come back. `Probe` sends requests exactly as written (any
bytes in the target) to a real `outlast dashboard` and judges each answer.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote

from outlast.storage.records import (
    MANIFEST_NAME,
    AttemptRecord,
    CheckpointRecord,
    FailureRecord,
    Manifest,
    OutputFile,
    ReportEntry,
    ReportSegment,
    RunState,
    encode,
    report_segment_name,
)
from outlast.protocol.messages import FileEntry
from outlast.storage.checksum import hash_file

GOOD = "good"
CHECKPOINT = "checkpoint_000001"
HUGE_BYTES = (16 << 20) + 1  # one past the dashboard's limit on a document (bounded.MAX_DOCUMENT_BYTES)

# Path segments, as sent on the wire (already percent-encoded where they need it).
HOSTILE_SEGMENTS = [
    "", ".", "..", "%2e%2e", "%2E%2E", "..%2f..%2f..%2fetc%2fpasswd", "%2e%2e%2f%2e%2e%2fcanary.txt",
    "%252e%252e%252f", "..%5c..%5c", "%00", "a%00b", "%ff%fe", "%c0%ae%c0%ae", "%ef%bc%8e%ef%bc%8e",
    "%D9%A1", "%F0%9D%9F%99", "-1", "0x10", "1_0", "%201", "+1", "1e3", "9" * 40, "9" * 5000, "a" * 300,
    "a" * 70000, "%2f", "%2F%2F", "~", "*", "%3f", "%23", "%25", "con", "null", "true", "[]", "%7B%7D",
    "%E2%80%AE", "%F4%8F%BF%BF", "%ED%A0%80", "run_state.json", "..%2Frun_state.json", "static",
    "checkpoints", "logs", "reports", ".outlast-manifest.json", "%C3%BC%C3%B1%C3%AF",
]
RAW_BYTES = [b"\xff", b"\x80..", b"\xc3\xbc", b" ", b"\t", b"\x7f", b"\x01"]
QUERY_KEYS = ["token", "attempt", "lines", "check", "x", "", "attempt%00", "lines[]"]


@dataclass
class Storage:
    root: Path
    log_dir: Path
    canary: str
    names: list[str]
    checkpoints: list[str]


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _state(name: str, **kw) -> RunState:
    return RunState(name=name, status=kw.pop("status", "finished"), created_at=1.0, updated_at=2.0, **kw)


def hostile_storage(base: Path, log_dir: Path) -> Storage:
    """Under `base`: storage/ (the runs), outside/ (the canary, where no route may reach). `log_dir` is the
    dashboard's node log directory ($OUTLAST_HOME/logs)."""
    canary = "CANARY-" + os.urandom(12).hex()
    root, outside = base / "storage", base / "outside"
    _write(outside / "canary.txt", canary.encode())
    _write(outside / "attempt1-rank0.log", f"{canary}\n".encode())
    _write(outside / "run_state.json", encode(_state("linked", error=canary)))
    _write(outside / "segment.json", encode(ReportSegment(
        attempt=1, first_index=0, reports=[ReportEntry(index=0, time=1.0, metrics={"x": canary})])))
    _write(outside / "linkrun" / "run_state.json", encode(_state("linkrun", error=canary)))
    _write(outside / "logs" / "shaped-1" / "attempt1-rank0.log", f"{canary}\n".encode())

    (log_dir / f"{GOOD}-1").mkdir(parents=True, exist_ok=True)
    _write(log_dir / f"{GOOD}-1" / "attempt1-rank0.log", b"rank 0 step 1\nrank 0 step 2\n")
    (log_dir / "link-1").mkdir(exist_ok=True)
    (log_dir / "link-1" / "attempt1-rank0.log").symlink_to(outside / "canary.txt")
    (log_dir / "linkdir-1").symlink_to(outside)

    def run(name: str, data: bytes) -> None:
        _write(root / name / "run_state.json", data)

    ckpt = CheckpointRecord(checkpoint_dir=CHECKPOINT, seq=1, attempt=1, report_index=1, committed_at=1.5,
                            metrics={"loss": 0.5})
    good = _state(GOOD, attempts=[AttemptRecord(
        attempt=1, started_at=1.0, ended_at=2.0, outcome="failed", workers=1,
        failures=[FailureRecord(attempt=1, rank=0, pid=1, node_id="n", time=1.9, exit_code=1, signal=None,
                                exc_type="E", message="m", traceback="Traceback (most recent call last):\n  boom")],
        outputs=[OutputFile(rank=0, node_id="n", path=str(log_dir / f"{GOOD}-1" / "attempt1-rank0.log"))])],
        checkpoints=[ckpt], latest_checkpoint=CHECKPOINT, last_metrics={"loss": 0.5})
    run(GOOD, encode(good))
    _write(root / GOOD / CHECKPOINT / "weights.bin", b"w" * 64)
    manifest = Manifest(checkpoint_dir=CHECKPOINT, seq=1, attempt=1, report_index=1, committed_at=1.5, ranks=[0],
                        files=[FileEntry(path="weights.bin", size=64,
                                         xxh3_128=hash_file(root / GOOD / CHECKPOINT / "weights.bin")[1])])
    _write(root / GOOD / CHECKPOINT / MANIFEST_NAME, encode(manifest))
    _write(root / GOOD / report_segment_name(1, 0), encode(ReportSegment(
        attempt=1, first_index=0, reports=[ReportEntry(index=i, time=1.0 + i / 10, metrics={"loss": 1.0 / (i + 1)})
                                           for i in range(5)])))

    # Documents that are not documents.
    run("garbage", b"{not json")
    run("binary", bytes(range(256)) * 4)
    run("empty", b"")
    run("null", b"null")
    run("list", b"[1, 2, 3]")
    run("wrongtypes", json.dumps({"version": 1, "name": 5, "status": [], "created_at": "x", "attempts": "x"}).encode())
    run("newer", json.dumps({"version": 99, "name": "newer", "status": "running"}).encode())
    run("negversion", json.dumps({"version": -1, "name": "negversion", "status": "running", "created_at": 1,
                                  "updated_at": 1}).encode())
    run("bigversion", b'{"version": ' + b"9" * 5000 + b', "name": "x"}')
    run("deep", b"[" * 200_000 + b"]" * 200_000)
    run("huge", b" " * HUGE_BYTES)
    run("hugestring", b'{"version": 1, "name": "' + b"x" * (HUGE_BYTES // 2) + b'"}')
    (root / "fifo").mkdir(parents=True)
    os.mkfifo(root / "fifo" / "run_state.json")
    (root / "dirstate" / "run_state.json").mkdir(parents=True)
    (root / "linkstate").mkdir()
    (root / "linkstate" / "run_state.json").symlink_to(outside / "run_state.json")
    (root / "linkrun").symlink_to(outside / "linkrun")
    # Histories with hostile values: extreme numbers, names of files elsewhere, checkpoints that are not there.
    run("extremes", encode(_state("extremes", status="running", attempts=[
        AttemptRecord(attempt=-5, started_at=1e308, ended_at=-1e308, workers=-1),
        AttemptRecord(attempt=2 ** 62, started_at=0.0, ended_at=None, workers=2 ** 62)],
        failure_counts={"worker": -(2 ** 62)}, latest_checkpoint="../../outside",
        last_metrics={"loss": 1e308, "x": [[[]]], "": None, "\u202e": "\x00"})))
    run("outputs", encode(_state("outputs", attempts=[AttemptRecord(attempt=1, started_at=1.0, outputs=[
        OutputFile(rank=0, node_id="n", path=str(outside / "canary.txt")),
        OutputFile(rank=1, node_id="n", path=f"{log_dir}/outputs-1/../../../outside/canary.txt"),
        OutputFile(rank=2, node_id="n", path=str(log_dir / "link-1" / "attempt1-rank0.log")),
        OutputFile(rank=3, node_id="n", path=str(log_dir / "linkdir-1" / "attempt1-rank0.log")),
        OutputFile(rank=4, node_id="n", path=str(outside / "logs" / "shaped-1" / "attempt1-rank0.log")),
        OutputFile(rank=5, node_id="n", path="relative/attempt1-rank5.log"),
        OutputFile(rank=6, node_id="n", path=""),
        OutputFile(rank=7, node_id="n", path="/etc/hostname"),
        OutputFile(rank=8, node_id="n", path=f"{log_dir}/outputs-1/attempt1-rank8.log\x00.txt")])])))
    bad_ckpts = ["../../outside", CHECKPOINT, "", "x" * 300, "garbage", "escape"]
    run("manifests", encode(_state("manifests", checkpoints=[
        CheckpointRecord(checkpoint_dir=c, seq=i, attempt=1, report_index=0, committed_at=1.0)
        for i, c in enumerate(bad_ckpts)])))
    _write(root / "manifests" / CHECKPOINT / MANIFEST_NAME, b" " * HUGE_BYTES)
    _write(root / "manifests" / "garbage" / MANIFEST_NAME, b"{]")
    # A manifest outlast cannot make (its paths are checked when built and read), written as a stranger would.
    _write(root / "manifests" / "escape" / MANIFEST_NAME, encode(Manifest(
        checkpoint_dir="escape", seq=5, attempt=1, report_index=0, committed_at=1.0, ranks=[0],
        files=[FileEntry(path="escape-1", size=10, xxh3_128="0" * 32),
               FileEntry(path="escape-2", size=10, xxh3_128="0" * 32)])).replace(
        b'"escape-1"', b'"../../../outside/canary.txt"').replace(b'"escape-2"', b'"/etc/hostname"'))
    for name, segment in [("reportgarbage", b"{"), ("reporthuge", b" " * HUGE_BYTES),
                          ("reporttypes", b'{"attempt": "1", "first_index": [], "reports": {}}')]:
        run(name, encode(_state(name, attempts=[AttemptRecord(attempt=1, started_at=1.0, ended_at=2.0)])))
        _write(root / name / report_segment_name(1, 0), segment)
    run("reportlink", encode(_state("reportlink", attempts=[AttemptRecord(attempt=1, started_at=1.0)])))
    (root / "reportlink" / "reports").mkdir()
    (root / "reportlink" / report_segment_name(1, 0)).symlink_to(outside / "segment.json")
    for odd in ["sp ace", "ünï", "%2e%2e", "..."]:
        run(odd, encode(_state(odd)))
    names = sorted(p.name for p in root.iterdir())
    return Storage(root=root, log_dir=log_dir, canary=canary, names=names, checkpoints=bad_ckpts)


def segment(rng: random.Random, storage: Storage) -> str:
    """One path segment: a name the storage has, a hostile one, or random characters, percent-encoded."""
    roll = rng.random()
    if roll < 0.35:
        return quote(rng.choice(storage.names), safe="")
    if roll < 0.7:
        return rng.choice(HOSTILE_SEGMENTS)
    alphabet = "ab.%/\\\x00ü١𝟙 ?#&=~" + "".join(chr(rng.randrange(0x20, 0x2FFFF)) for _ in range(4))
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
    return quote(text, safe=".%~", errors="surrogatepass")  # a lone surrogate: bytes that are not UTF-8


def target(rng: random.Random, storage: Storage) -> bytes:
    """A request target aimed at one of the dashboard's routes, with hostile parts."""
    i = rng.choice(["0", "0", "1", "-1", "00", "%30", "9" * 30] + [segment(rng, storage)])
    name = segment(rng, storage)
    number = rng.choice(["0", "1", "7", "-1", "99999999999", "%D9%A1", "1.5", segment(rng, storage)])
    ckpt = rng.choice([quote(c, safe="") for c in storage.checkpoints] + [segment(rng, storage)])
    path = rng.choice([
        "/", "/runs", "/cluster", "/favicon.ico", f"/runs/{i}/{name}", "/api/runs", "/api/cluster",
        f"/api/runs/{i}/{name}", f"/api/runs/{i}/{name}/checkpoints/{ckpt}",
        f"/api/runs/{i}/{name}/logs/{number}", f"/static/{segment(rng, storage)}", "/static/app.js",
        "/" + "/".join(segment(rng, storage) for _ in range(rng.randrange(0, 6)))])
    if rng.random() < 0.5:
        params = [f"{rng.choice(QUERY_KEYS)}={rng.choice(['1', '0', '', '-1', '100000', '100001', number])}"
                  for _ in range(rng.randrange(1, 4))]
        path += "?" + "&".join(params)
    raw = path.encode()
    if rng.random() < 0.05:
        raw += rng.choice(RAW_BYTES)
    return raw


# The dashboard's routes (outlast/cli/dashboard/app.py), as `route_of` names them: every one must be asked.
ROUTES = ("/", "/favicon.ico", "/runs", "/cluster", "/runs/{storage}/{name}", "/api/runs", "/api/cluster",
          "/api/runs/{storage}/{name}", "/api/runs/{storage}/{name}/checkpoints/{checkpoint}",
          "/api/runs/{storage}/{name}/logs/{rank}", "/static/{path}")
NO_ROUTE = "no route"


def route_of(raw_target: bytes) -> str:
    """The route a request target reaches, as Starlette matches it: on the path percent-decoded, a
    `{parameter}` being one segment that is not empty. `NO_ROUTE` for any other path."""
    path = unquote(raw_target.split(b"?", 1)[0].decode("latin-1"))
    parts = path.split("/")[1:]
    named = {("",): "/", ("favicon.ico",): "/favicon.ico", ("runs",): "/runs", ("cluster",): "/cluster",
             ("api", "runs"): "/api/runs", ("api", "cluster"): "/api/cluster"}
    if tuple(parts) in named:
        return named[tuple(parts)]
    if parts[:1] == ["static"] and len(parts) > 1:
        return "/static/{path}"
    if len(parts) == 3 and parts[0] == "runs" and all(parts[1:]):
        return "/runs/{storage}/{name}"
    if parts[:2] == ["api", "runs"] and all(parts[2:]):
        if len(parts) == 4:
            return "/api/runs/{storage}/{name}"
        if len(parts) == 6 and parts[4] == "checkpoints":
            return "/api/runs/{storage}/{name}/checkpoints/{checkpoint}"
        if len(parts) == 6 and parts[4] == "logs":
            return "/api/runs/{storage}/{name}/logs/{rank}"
    return NO_ROUTE


@dataclass
class Verdict:
    requests: int = 0
    by_status: Counter = field(default_factory=Counter)
    by_route: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        classes = Counter()
        for status, n in self.by_status.items():
            classes[f"{status // 100}xx" if isinstance(status, int) else status] += n
        return {"requests": self.requests, "by_class": dict(sorted(classes.items())),
                "by_status": {str(k): v for k, v in sorted(self.by_status.items(), key=str)},
                "by_route": dict(self.by_route.most_common()),
                "problems": len(self.problems), "first_problems": self.problems[:10]}


class Probe:
    """One keep-alive connection to the dashboard, reopened when the server closes it."""

    def __init__(self, port: int, storage: Storage, host: str = "127.0.0.1", token: str | None = None) -> None:
        self.port, self.storage, self.host, self.token = port, storage, host, token
        self.sock: socket.socket | None = None
        self.verdict = Verdict()
        self.last = b""  # the request judged last

    def send(self, raw_target: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        head = {"Host": f"{self.host}:{self.port}", **(headers or {})}
        data = b"GET " + raw_target + b" HTTP/1.1\r\n" + b"".join(
            f"{k}: {v}\r\n".encode("utf-8", "surrogateescape") for k, v in head.items()) + b"\r\n"
        for retry in (True, False):
            if self.sock is None:
                self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=120)
            try:
                self.sock.sendall(data)
                response = http.client.HTTPResponse(self.sock, method="GET")
                response.begin()
                body = response.read()
                if response.will_close:
                    self.close()
                return response.status, body
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
                self.close()  # the server closed a kept-alive connection (after a request it refused): again
                if not retry:
                    raise
        raise AssertionError("unreachable")

    def judge(self, raw_target: bytes, headers: dict[str, str] | None = None) -> int:
        v = self.verdict
        self.last = raw_target
        v.by_route[route_of(raw_target)] += 1
        try:
            status, body = self.send(raw_target, headers)
        except (http.client.HTTPException, OSError) as e:
            v.requests += 1
            v.problems.append(f"no answer that HTTP can read for {raw_target[:200]!r}: {type(e).__name__}: {e}"[:500])
            self.close()
            return 0
        v.requests += 1
        v.by_status[status] += 1
        where = raw_target[:200]
        if status >= 500 and status != 503:
            v.problems.append(f"{status} for {where!r}: {body[:300]!r}")
        if b"Traceback" in body and not raw_target.startswith(b"/api/runs/0/good") and b"boom" not in body:
            v.problems.append(f"a traceback for {where!r}")
        if self.storage.canary.encode() in body:
            v.problems.append(f"the canary's bytes for {where!r}")
        return status

    def alive(self) -> None:
        """A valid request after each: the server still answers it, whole."""
        try:
            status, body = self.send(b"/api/runs/0/good", self._auth())
        except (http.client.HTTPException, OSError) as e:
            self.verdict.problems.append(f"the good run did not come back after {self.last[:200]!r}: "
                                         f"{type(e).__name__}: {e}")
            self.close()
            return
        if status != 200 or json.loads(body).get("name") != GOOD:
            self.verdict.problems.append(f"the good run did not come back after a request: {status} {body[:200]!r}")

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def headers(self, rng: random.Random) -> dict[str, str]:
        """Mostly the right credentials; sometimes none, a wrong token, a hostile Host or cookie."""
        roll = rng.random()
        out = self._auth() if roll < 0.8 else {}
        if 0.8 <= roll < 0.85 and self.token:
            out["Authorization"] = rng.choice(["Bearer ", "Bearer " + self.token[:-1], "Basic x", self.token,
                                               "Bearer " + "x" * 5000])
        elif 0.85 <= roll < 0.9:
            out["Cookie"] = rng.choice(["outlast_dashboard_token=", "outlast_dashboard_token=" + "\x7f" * 10,
                                        "a=b; outlast_dashboard_token=wrong", "=" * 100])
        elif 0.9 <= roll < 0.93:
            out["Host"] = rng.choice(["attacker.example", "", "127.0.0.1:1", "[::1]", "localhost", "x" * 3000])
        return out

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
