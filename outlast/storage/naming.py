"""Where a checkpoint lives in its run's directory: outlast's own names, and the names a user asks for.

A report without `checkpoint_dir_name` gets `checkpoint_AAA_IIIIII`, which every rank derives from
counts it already has. A report with one is stored under that name, as on Ray. Either way the
manifest written last is what makes the directory a committed checkpoint. A named directory also
gets a marker, written before any of its files, naming the report it holds: so a crash mid-upload
leaves a directory that the clean-up knows for an uncommitted checkpoint, while a directory of the
user's own (no marker, no outlast name) is never touched.
"""

from __future__ import annotations

import re

import msgspec

from outlast.storage import records as r

MARKER_NAME = ".outlast-checkpoint.json"
# The run directory's own entries: a checkpoint by one of these names would write over them.
RESERVED = frozenset({r.RUN_STATE_NAME, r.REPORTS_DIR, r.LEASE_NAME, r.RETURN_VALUE_NAME})
MAX_NAME_BYTES = 255  # a path component on ext4, xfs, APFS and NTFS
CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # searched in C: a name read from storage may be any length


class CheckpointMarker(msgspec.Struct, frozen=True, kw_only=True):
    """Written first into a named checkpoint's directory, by each rank with files for it."""

    version: int = r.SCHEMA_VERSION
    attempt: int
    report_index: int


class CheckpointNameError(ValueError):
    """A `report(checkpoint_dir_name=...)` that outlast cannot store as asked; nothing was written."""


def default_name(attempt: int, report_index: int) -> str:
    """Every rank derives the same name from counts it already has: no agreement needed."""
    return f"checkpoint_{attempt:03d}_{report_index:06d}"


def is_default_name(name: str) -> bool:
    parts = name.split("_")
    return len(parts) == 3 and parts[0] == "checkpoint" and parts[1].isdigit() and parts[2].isdigit()


def name_problem(name: object) -> str | None:
    """Why `name` cannot name a checkpoint's directory, or None when it can."""
    if not isinstance(name, str):
        return f"it must be a str, got {type(name).__name__}"
    if not name:
        return "it is empty"
    if "/" in name or "\\" in name:
        return "it must be one directory name, without '/' or '\\'"
    if CONTROL.search(name):
        return "it holds a control character"
    if name.startswith("."):
        return "names starting with '.' are kept for outlast's own files"
    if len(name.encode()) > MAX_NAME_BYTES:
        return f"it is {len(name.encode())} bytes long; file systems allow {MAX_NAME_BYTES}"
    if name in RESERVED:
        return f"the run directory keeps its own {name!r} there"
    if is_default_name(name):
        return "names of the form checkpoint_AAA_IIIIII are the ones outlast gives checkpoints reported without one"
    return None


def check_name(name: object) -> str:
    """`name`, or a `CheckpointNameError` saying what to change."""
    problem = name_problem(name)
    if problem is None and isinstance(name, str):  # (name_problem refuses whatever is not a str)
        return name
    raise CheckpointNameError(f"report(checkpoint_dir_name={name!r}) cannot be used: {problem}. Pass a "
                              "name unique to this report, e.g. with its epoch or step: 'epoch_3'")


def clash(name: str, uri: str, attempt: int, report_index: int, found: CheckpointMarker | None,
          committed: bool, occupied: bool) -> str | None:
    """Why report `report_index` of `attempt` may not store its files under `name`, judged from what is there.

    `found` is the directory's marker, `committed` whether it has a manifest, `occupied` whether
    anything is at that path. Another rank of the same report (the same marker) is no clash."""
    if found is not None:
        if (found.attempt, found.report_index) == (attempt, report_index):
            return None
        what = "committed" if committed else "still being uploaded"
        return (f"checkpoint_dir_name={name!r} is taken: {uri} holds the checkpoint of report #{found.report_index} "
                f"of attempt {found.attempt} ({what}). Each report needs a name of its own: add the epoch or step "
                "to it, or report without checkpoint_dir_name to let outlast name it")
    if occupied:
        return (f"checkpoint_dir_name={name!r} is taken: {uri} is already there and is not a checkpoint of this "
                "run, so outlast leaves it alone. Choose another name, or move it out of the run's directory")
    return None


def encode_marker(attempt: int, report_index: int) -> bytes:
    return msgspec.json.encode(CheckpointMarker(attempt=attempt, report_index=report_index))


def decode_marker(data: bytes) -> CheckpointMarker | None:
    """None for a marker that cannot be read (a crash mid-write): it still marks a checkpoint's directory."""
    try:
        return msgspec.json.decode(data, type=CheckpointMarker)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
