"""Hostile documents for the readers of what outlast keeps in storage, in its state directory and in etcd,
and a storage that records every path it is asked for (the real `LocalStorage`, watched).

Each `read_*` plants one generated document where outlast keeps it, reads it as outlast does, and
returns the class of what came out ("ok", or the error's class). An error other than the ones each
reader documents is a crash; a path asked of storage outside the run's directory is a read outside
the root (`WatchedStorage.outside`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgspec
from msgspec import inspect as mi

from outlast.storage import naming, records as r
from outlast.storage.lease import Lease
from outlast.storage.local import LocalStorage
from tests.fuzz.hostile import Hostile

RUN = "run"


class WatchedStorage(LocalStorage):
    """LocalStorage that notes every path asked of it that resolves outside `inside`."""

    def __init__(self, root: Path, inside: str) -> None:
        super().__init__(root)
        self.inside = (self.root / inside).resolve()
        self.outside: list[str] = []

    def _p(self, path: str) -> Path:
        p = super()._p(path)
        try:
            resolved = p.resolve()
        except (OSError, ValueError, RuntimeError):
            resolved = p
        if resolved != self.inside and self.inside not in resolved.parents:
            self.outside.append(path)
        return p


def document(h: Hostile, kind: type) -> bytes:
    """One document of `kind` with hostile fields, or bytes that are no document, cut short, or from the future."""
    r_ = h.rng.random()
    value = h.struct(mi.type_info(kind))
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


def seeded(seed: int, targets) -> Hostile:
    return Hostile(random.Random(seed), targets)


def environ_with_home(home: Path) -> dict[str, str]:
    return {**os.environ, "OUTLAST_HOME": str(home)}
