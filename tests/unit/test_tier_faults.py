"""What a run's end and an eviction take with them from the memory tier: the links its restores made too."""

import os
from pathlib import Path

from outlast.protocol import messages as m
from outlast.storage.checksum import hash_file
from outlast.storage.local import LocalStorage
from outlast.storage.records import Manifest
from outlast.storage.run_store import RunStore
from outlast.storage.tier_restore import restore
from outlast.storage.tier_store import TierStore

MB = 2**20


# ---- restore links ---------------------------------------------------------------------------------------


def _held_and_restored(tmp_path: Path, s: TierStore, name: str, seq: int) -> Path:
    """A copy of checkpoint `name` held on n1, with a manifest in storage, restored from memory: its links."""
    storage = LocalStorage(tmp_path / "storage")
    src = tmp_path / name
    src.mkdir()
    (src / "model.pt").write_bytes(os.urandom(MB))
    entries = [m.FileEntry(path="model.pt", size=MB, xxh3_128=hash_file(src / "model.pt")[1])]
    assert s.put_dir(storage.uri("run"), name, 0, seq, entries, src) is None
    RunStore(storage, "run").write_manifest(Manifest(checkpoint_dir=name, seq=seq, attempt=0, report_index=seq,
                                                     committed_at=1.0, ranks=[0], files=entries))
    path, _source, _said = restore(storage, "run", name, tmp_path / "cache", "n1", s.root)
    assert path.is_relative_to(s.home / "restores")
    return path


def test_freeing_a_run_takes_the_links_its_restores_made_with_its_copies(tmp_path):
    s = TierStore(tmp_path / "tier", "n1", 64 * MB)
    s.open()
    linked = _held_and_restored(tmp_path, s, "checkpoint_000_000001", 1)
    s.free_run(LocalStorage(tmp_path / "storage").uri("run"))
    assert not linked.exists()
    assert [p for p in s.home.rglob("*") if p.name != "owner.json" and p != s.home / "restores"] == []


def test_an_evicted_copy_takes_its_restore_links_with_it(tmp_path):
    # Room for one copy: the second evicts the first, whose restore's links would keep its bytes outside the budget.
    s = TierStore(tmp_path / "tier", "n1", MB + MB // 2)
    s.open()
    first = _held_and_restored(tmp_path, s, "checkpoint_000_000001", 1)
    src = tmp_path / "second"
    src.mkdir()
    (src / "model.pt").write_bytes(os.urandom(MB))
    entries = [m.FileEntry(path="model.pt", size=MB, xxh3_128=hash_file(src / "model.pt")[1])]
    assert s.put_dir(LocalStorage(tmp_path / "storage").uri("run"), "checkpoint_000_000002", 0, 2, entries, src) is None
    assert not first.exists()
    # What the tier's files take: the second copy alone.
    inodes = {p.stat().st_ino: p.stat().st_size for p in s.home.rglob("*.pt")}
    assert sum(inodes.values()) == MB
