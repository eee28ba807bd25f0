"""The events a benchmark's runs append to a file, one JSON object a line, and reading them back.
Standard library only: Ray's workers import it too."""

from __future__ import annotations

import json


def emit(path: str, **event) -> None:
    """Appends `event` as one line in one write on an append-mode file, so that the lines of processes
    writing at the same time never interleave."""
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def read_events(path: str) -> list[dict]:
    """The events in `path` so far ([] before the first); a line still being written is left out."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("\n") and line.strip()]
