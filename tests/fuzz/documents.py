"""Hostile documents for the readers of what outlast keeps in storage, in its state directory and in etcd,
and a storage that records every path it is asked for (the real `LocalStorage`, watched).

Each case (`read_run`, `read_node_file`, `apply_records`) plants generated documents where outlast keeps
them, reads them as outlast does, and returns the class of what came out ("ok", or the error's class).
An error other than the ones each reader documents is a crash; a path asked of storage outside the run's
directory is a read outside the root (`WatchedStorage.outside`). The tests (tests/unit/test_fuzz_documents.py)
and bench/fuzz_doors.py run the same cases.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgspec

from outlast.client import discovery
from outlast.cluster.sealed import Sealer
from outlast.cluster.store_view import ClusterView, StoreEvent
from outlast.controller.runstate import RunBook
from outlast.protocol import messages as m
from outlast.storage import naming, records as r
from outlast.storage.lease import Lease
from outlast.storage.local import LocalStorage
from outlast.storage.run_store import RunStore
from tests.fuzz.hostile import Hostile, Targets, type_info

RUN = "run"


class WatchedStorage(LocalStorage):
    """LocalStorage that notes every path asked of it that lies outside `inside`.

    Judged on the path's text, normalized (`..` taken out): the planted run holds no link (`plant_run` makes
    none, and outlast's storage makes none), so no path inside by its text leads outside by a link, and
    resolving each on disk would cost more than the reading under test."""

    def __init__(self, root: Path, inside: str) -> None:
        super().__init__(root)
        self.inside = str((self.root / inside).resolve())
        self.outside: list[str] = []

    def _p(self, path: str) -> Path:
        p = super()._p(path)
        normal = os.path.normpath(p)
        if normal != self.inside and not normal.startswith(self.inside + os.sep):
            self.outside.append(path)
        return p


def document(h: Hostile, kind: type) -> bytes:
    """One document of `kind` with hostile fields, or bytes that are no document, cut short, or from the future."""
    r_ = h.rng.random()
    value = h.struct(type_info(kind))
    if isinstance(value, dict) and h.rng.random() < 0.8:
        value.pop("version", None)  # this outlast's: the rest of the document is read (a newer one is below)
    try:
        body = msgspec.json.encode(value)
    except (TypeError, ValueError, OverflowError):
        body = b"{}"
    if r_ < 0.7:
        return body
    if r_ < 0.8:
        return body[:h.rng.randint(0, max(0, len(body) - 1))]
    if r_ < 0.85:
        value["version"] = h.rng.choice([2, 3, 99, 2**63 - 1, -1, "1", None])
        try:
            return msgspec.json.encode(value)
        except (TypeError, ValueError, OverflowError):
            return body
    if r_ < 0.9:
        return h.rng.choice([b"", b"null", b"[]", b"{", b"\xff\xfe", b"0", b'"x"', b"[" * 10_000, b"{}"])
    return h.raw()


def _names(h: Hostile) -> list[str]:
    """Directories the run's directory holds: outlast's names, and hostile ones (what a writer of the path makes)."""
    out = ["checkpoint_000_000001"]
    for _ in range(h.rng.randint(0, 2)):
        name = h.string()
        if name and "/" not in name and "\0" not in name and name not in (".", "..") and len(name.encode()) < 200:
            out.append(name)
    return out


def plant_run(h: Hostile, root: Path) -> None:
    """A run's directory under `root` with hostile documents: its run state, manifests, markers, reports, lease."""
    run = root / RUN
    run.mkdir(parents=True, exist_ok=True)
    (run / r.RUN_STATE_NAME).write_bytes(document(h, r.RunState))
    (run / "driver_lease.json").write_bytes(document(h, Lease))
    (run / r.REPORTS_DIR).mkdir(exist_ok=True)
    for attempt in range(h.rng.randint(0, 2)):
        (run / r.report_segment_name(attempt, 0)).write_bytes(document(h, r.ReportSegment))
    for name in _names(h):
        try:
            (run / name).mkdir(exist_ok=True)
            (run / name / r.MANIFEST_NAME).write_bytes(document(h, r.Manifest))
            (run / name / naming.MARKER_NAME).write_bytes(document(h, naming.CheckpointMarker))
        except OSError:
            pass


def plant_decoy(canary: Path) -> None:
    """A valid run outside the root: a reader that follows a document's path out of its root finds it."""
    (canary / "ckpt").mkdir(parents=True, exist_ok=True)
    manifest = r.Manifest(checkpoint_dir="ckpt", seq=1, attempt=0, report_index=0, committed_at=1.0, ranks=[0],
                          files=[])
    (canary / "ckpt" / r.MANIFEST_NAME).write_bytes(r.encode(manifest))


# A document's long strings and bytes: longer than a name or a path may be. A list of a thousand items copies its
# few generated ones (`Hostile._many`), so 70 KB strings and 1 MiB bytes made documents of up to 64 MB, whose writing and encoding
# cost the door most of its time; a document larger than the reader takes is refused by its size before it is
# read (`RunStore._read_document`, tests/unit/test_run_store.py), which needs no fuzzing to show.
DOCUMENT_STRINGS = ["x" * n for n in (4096, 256)]
DOCUMENT_ZEROS = [b"\0" * 4096]


def hostile(seed: int, canary: Path) -> Hostile:
    """A document's generator: a wrong type now and then only, so that most documents are read past their
    first field; JSON's floats (no NaN)."""
    return Hostile(random.Random(seed), Targets(str(canary)), wrong=0.005, json=True, long_strings=DOCUMENT_STRINGS,
                   zeros=DOCUMENT_ZEROS)


def read_run(root: Path, canary: Path, seed: int) -> tuple[str, list[str]]:
    """Plant a hostile run under `root/store`, open it as a driver does and read its reports and lease:
    (what came of it, the paths asked of storage outside the run's directory)."""
    plant_run(hostile(seed, canary), root / "store")
    storage = WatchedStorage(root / "store", RUN)
    store = RunStore(storage, RUN)
    try:
        book = RunBook.open(store, RUN, 1000.0)
        for attempt in range(3):
            store.read_reports(attempt)
        store.read_lease()
        for name in [c.checkpoint_dir for c in book.state.checkpoints] + [book.state.latest_checkpoint or ""]:
            try:
                store.read_manifest(name)
            except r.CorruptDocument:
                pass
        outcome = "ok"
    except (r.NewerVersionError, r.CorruptDocument) as e:
        assert "store" in str(e) or RUN in str(e), f"the error names no file: {e}"
        outcome = type(e).__name__
    return outcome, storage.outside


def read_node_file(h: Hostile) -> str:
    """Write a hostile node file where $OUTLAST_HOME keeps it and look for the node it names, as a client
    does: no node, or one (never an error)."""
    discovery.node_file_path().write_bytes(document(h, discovery.NodeFile))
    info = discovery.read_node_file()
    assert info is None or isinstance(info, discovery.NodeFile), info
    node = discovery.published_node()
    assert node is None or isinstance(node, discovery.NodeFile), node
    return "no node" if node is None else "a node"


def apply_records(h: Hostile, sealer: Sealer, sealed: bool, count: int) -> str:
    """Apply `count` hostile etcd records (sealed with the cluster's key, or not) to a node table, as a node
    watching etcd does: each is taken, ignored, malformed or refused, never an error, and the table holds
    only nodes. Returns what came of the last."""
    view = ClusterView(sealer)
    last = "ignored"
    for _ in range(count):
        key = h.rng.choice(["head", "members/", "nodes/", "drains/", "dead/", ""]) + h.string()[:80]
        if h.rng.random() < 0.7:
            kind = m.NodeDraining if key.startswith("drains/") else m.NodeInfo
            value: bytes | None = document(h, kind) if not key.startswith("dead/") else h.rng.choice(
                [b"1.5", b"nan", b"-inf", b"1e999", b"x", b""])
        else:
            value = h.rng.choice([None, h.raw()])
        if sealed and value is not None:
            value = sealer.seal(key, value)
        refused, malformed = len(view.refused), len(view.malformed)
        changed = view.apply(StoreEvent(key, value))
        last = ("refused" if len(view.refused) > refused else "malformed" if len(view.malformed) > malformed else
                "taken" if changed else "ignored")
    for node in view.table():
        assert isinstance(node, m.NodeInfo), node
    assert not sealed or not view.refused, view.refused
    return last
