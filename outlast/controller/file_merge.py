"""One checkpoint's files from all the ranks that wrote some, as the manifest lists them.

Two ranks may write the same file. With the same bytes there is nothing to decide. With
different bytes (Ray's tutorial saves `model.pt` on every rank, and BatchNorm's running
statistics differ per rank) the policy decides:

- KEEP_RANK0 (the default, "keep_rank0"; "keep_one" is its former name): keep rank 0's copy,
  the rank the DDP convention trusts, and say so once (a warning and a note in the run's
  history, with the files and ranks). Storage guarantees it whatever the order of the uploads
  into the shared directory: rank 0 replaces a file atomically, every other rank only creates
  one that is absent (`Storage.upload_dir(replace=...)`). Of a file rank 0 did not write, the
  copy kept is the first one stored. The manifest lists the copy storage holds, checked
  against the ranks' checksums; bytes that match no rank's copy are refused, and the previous
  checkpoint stays the latest.
- FAIL: refuse the checkpoint (`CheckpointConfig(duplicate_files="fail")`).

`merge_files` and `settle` decide and have no effects; the core reads the stored checksums
through storage (`effects.ReadChecksums`), then logs and records the decision (`commits/machine.py`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from outlast.protocol.messages import FileEntry

log = logging.getLogger("outlast.controller")


class DuplicateFiles(enum.Enum):
    KEEP_RANK0 = "keep_rank0"
    FAIL = "fail"

    @classmethod
    def _missing_(cls, value: object) -> DuplicateFiles | None:
        return cls.KEEP_RANK0 if value == "keep_one" else None  # the former name, for configs that say it


@dataclass(frozen=True)
class Conflict:
    """`path` was written with different contents by `ranks` (sorted); `kept` is the rank whose copy stays."""

    path: str
    ranks: tuple[int, ...]
    entries: tuple[FileEntry, ...]  # one per rank of `ranks`
    kept: int


@dataclass(frozen=True)
class MergedFiles:
    files: list[FileEntry]
    conflicts: list[Conflict]

    def describe(self) -> str:
        """The conflicts in words, without the checkpoint's name: the same ranks writing the same files
        at every checkpoint read the same, so the history records it once."""
        parts = [f"{c.path!r} (ranks {', '.join(map(str, c.ranks))})" for c in self.conflicts]
        return (f"ranks wrote different contents to the same checkpoint file{'s' if len(parts) > 1 else ''} "
                f"{', '.join(parts)}; each checkpoint keeps rank 0's copy (of a file rank 0 did not write, the first "
                "copy stored) and drops the others. Save replicated state from rank 0 only, or "
                "give each rank its own file names; CheckpointConfig(duplicate_files='fail') refuses such a "
                "checkpoint instead")


def merge_files(files_by_rank: Mapping[int, list[FileEntry]], policy: DuplicateFiles) -> MergedFiles:
    """The union of every rank's files, one entry per path, the lowest rank's copy for now (`settle`
    picks the copy storage holds). Raises ValueError under FAIL on a conflict."""
    chosen: dict[str, tuple[int, FileEntry]] = {}
    writers: dict[str, list[tuple[int, FileEntry]]] = {}
    for rank in sorted(files_by_rank):
        for entry in files_by_rank[rank]:
            seen = chosen.get(entry.path)
            if seen is None:
                chosen[entry.path] = (rank, entry)
                writers[entry.path] = [(rank, entry)]
                continue
            if any(e.checksum == entry.checksum for _, e in writers[entry.path]):
                continue
            if policy is DuplicateFiles.FAIL:
                raise ValueError(
                    f"ranks {seen[0]} and {rank} both wrote {entry.path!r} with different contents; "
                    "save a replicated model from one rank only, or give each rank its own file names "
                    "(CheckpointConfig(duplicate_files='keep_rank0') keeps rank 0's copy and says so)"
                )
            writers[entry.path].append((rank, entry))
    conflicts = [Conflict(path, tuple(r for r, _ in w), tuple(e for _, e in w), kept=w[0][0])
                 for path, w in sorted(writers.items()) if len(w) > 1]
    return MergedFiles([e for _, e in sorted(chosen.values(), key=lambda x: x[1].path)], conflicts)


def settle(merged: MergedFiles, stored: Mapping[str, tuple[str, str] | None]) -> MergedFiles:
    """Each conflicting file's entry becomes the copy that storage holds (`stored`: path -> its
    (algorithm, digest), in the algorithm of the ranks' entries).

    Raises ValueError when the stored bytes match no rank's copy.
    """
    conflicts, replace = [], {}
    for c in merged.conflicts:
        match = [(r, e) for r, e in zip(c.ranks, c.entries) if e.checksum == stored.get(c.path)]
        if not match:
            raise ValueError(f"ranks {', '.join(map(str, c.ranks))} wrote {c.path!r} with different contents at "
                             "the same time and the stored file matches none of them; save replicated state "
                             "from rank 0 only, or give each rank its own file names")
        rank, entry = match[0]
        conflicts.append(Conflict(c.path, c.ranks, c.entries, kept=rank))
        replace[c.path] = entry
    return MergedFiles([replace.get(e.path, e) for e in merged.files], conflicts)
