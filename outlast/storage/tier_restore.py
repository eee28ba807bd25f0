"""A restore from this node's memory tier: the checkpoint's files put together from the copies held here.

A checkpoint's files came from several ranks, and the node holds copies of some of them (its
own ranks', the replicas it keeps for a peer, those fetched from a peer for this restore).
For each file of the manifest the first copy here whose record names the same file is checked
against the manifest's size and checksum; a copy that differs is passed over for the next
one. The files are linked, not copied, into one directory per run (tmpfs: the same file
system), so that a restore costs the checks alone. When some file has no whole copy here,
there is no directory and the restore goes on to storage, saying why.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec

from outlast.protocol.messages import FileEntry
from outlast.storage import safepath
from outlast.storage.base import Storage
from outlast.storage.memtier import SourceKind
from outlast.storage.records import CorruptDocument, Manifest
from outlast.storage.restore import CorruptCheckpointError, materialize
from outlast.storage.run_store import RunStore
from outlast.storage.tier_store import TierRecord, check_files, default_root, run_dir_name

W = TypeVar("W")  # where a copy's files are


def held_here(root: Path, node_id: str, run: str, checkpoint_dir: str) -> list[tuple[TierRecord, Path]]:
    """The copies of `checkpoint_dir` this node holds: their records and directories."""
    out = []
    for record_path in sorted((root / node_id / run_dir_name(run) / checkpoint_dir).glob("rank-*.json")):
        try:
            record = msgspec.json.decode(record_path.read_bytes(), type=TierRecord)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue  # being replaced, or torn: not a copy to read
        out.append((record, record_path.with_suffix("")))
    return out


def choose_copies(files: list[FileEntry], copies: list[tuple[TierRecord, W]], node_id: str,
                  check: Callable[[W, FileEntry], str | None]) -> tuple[dict[str, W] | None, list[str], list[int]]:
    """For each file of a manifest, the copy to read it from: the first held here (primary ones first) whose
    record names the same file and whose file passes `check` (size and checksum against the manifest).

    Returns (path -> the copy's place, or None when some file has no whole copy here; what was passed over
    and why; the ranks whose files come from a replica of another node's copy). Pure but for `check`, so
    that whatever keeps copies (files here, a simulated node's memory) decides as a restore does."""
    ordered = sorted(copies, key=lambda rc: (not rc[0].primary, rc[0].rank))
    chosen: dict[str, W] = {}
    said: list[str] = []
    replicas: list[int] = []
    for entry in files:
        for record, where in ordered:
            if not any(f.path == entry.path and f.size == entry.size and f.checksum == entry.checksum
                       for f in record.files):
                continue
            why = check(where, entry)
            if why is None:
                chosen[entry.path] = where
                if not record.primary and record.rank not in replicas:
                    replicas.append(record.rank)
                break
            said.append(f"the copy of rank {record.rank} in memory on {node_id} was skipped: {why}")
        else:
            said.append(f"file {entry.path} has no whole copy in memory on {node_id}")
            return None, said, replicas
    return chosen, said, replicas


def assemble(root: Path, node_id: str, run: str, manifest: Manifest,
             replicas: list[int] | None = None) -> tuple[Path | None, list[str]]:
    """A directory with every file of `manifest` from this node's tier, each checked; else None and why.
    `replicas` gets the ranks whose files came from a replica of another node's copy."""
    copies = held_here(root, node_id, run, manifest.checkpoint_dir)
    found, said, from_replicas = choose_copies(manifest.files, copies, node_id,
                                               lambda where, entry: check_files(where, [entry]))
    if replicas is not None:
        replicas.extend(r for r in from_replicas if r not in replicas)
    if found is None:
        return None, said
    restores = root / node_id / "restores" / run_dir_name(run)
    restores.mkdir(parents=True, exist_ok=True)
    target = restores / manifest.checkpoint_dir
    # The ranks of a node restore together: the first one links the files, the others check and reuse them.
    with open(restores / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir() and check_files(target, manifest.files) is None:
            return target, said
        partial = restores / f".{manifest.checkpoint_dir}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for rel, where in found.items():
            safepath.link_under(where, rel, partial)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
        for old in restores.iterdir():  # one restore per run: linked pages outside the budget stay few
            if old != target and not old.name.startswith("."):
                shutil.rmtree(old, ignore_errors=True)
    return target, said


def restore(storage: Storage, run_dir: str, name: str, cache_root: Path, node_id: str,
            root: Path | None = None, replicas: list[int] | None = None) -> tuple[Path, SourceKind, list[str]]:
    """Checkpoint `name` from this node's memory first, then from storage: its directory, where it came
    from, and why memory was passed over (empty when it was not). `replicas` gets the ranks whose files were
    read from a replica this node keeps of another node's copy."""
    store = RunStore(storage, run_dir)
    try:
        manifest = store.read_manifest(name)
    except CorruptDocument as e:
        raise CorruptCheckpointError(name, str(e)) from None
    said: list[str] = []
    if manifest is not None and node_id:
        path, said = assemble(root or default_root(), node_id, storage.uri(run_dir), manifest, replicas)
        if path is not None:
            return path, SourceKind.LOCAL_MEMORY, said
    return materialize(storage, run_dir, name, cache_root), SourceKind.STORAGE, said
