"""What `--json` prints: versioned documents for scripts (`outlast status --json`, `outlast runs ...
--json`), described in docs/json.md, their JSON Schemas generated from these types and kept in
docs/schemas/ (a test checks the two agree, so a change to a document is a change to its schema).

The run-state file's rules apply: a field may be added under the same version (readers ignore
fields they do not know); renaming, removing or changing the meaning of one is a new version.

    python -m outlast.cli.documents docs/schemas     # write the schemas again after a change
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

import msgspec

from outlast.protocol import messages as m
from outlast.storage.goodput import Goodput
from outlast.storage.metric_values import stored
from outlast.storage.records import RunState

VERSION = 1
# outlast.run 2: a failure's `kind` holds outlast's own kinds, and `exc_type` only the names of exceptions ranks
# raised (run states of version 2); run.v1.json stays beside it for the documents of version 1.
RUN_VERSION = 2


class StatusDocument(msgspec.Struct, kw_only=True):
    """`outlast status --json`: the node on this machine and its cluster's node table."""

    kind: Literal["outlast.status"] = "outlast.status"
    version: Literal[1] = VERSION
    node: m.StatusReply  # this node: its runs, workers, isolation, kills, drain, metrics endpoint
    role: Literal["head", "member"]
    head_address: str  # the head's address ("" on the head itself)
    nodes: list[m.NodeInfo]  # the head's node table; empty when the head does not answer
    head_answered: bool


class RunSummary(msgspec.Struct, kw_only=True):
    name: str
    status: str | None = None  # the controller state's name: running, finished, errored, ...
    attempts: int = 0
    failures: int = 0  # root causes, not the peers they took down
    checkpoints: int = 0
    latest_checkpoint: str | None = None
    unreadable: str | None = None  # set (and the rest left empty) when its run state cannot be read
    failure_counts: dict[str, int] = {}  # root causes by kind
    last_metrics: dict[str, Any] | None = None  # rank 0's last report
    updated_at: float | None = None
    workers: int | None = None  # the latest attempt's world size


class RunsDocument(msgspec.Struct, kw_only=True):
    """`outlast runs STORAGE_PATH --json`: every run under a storage path."""

    kind: Literal["outlast.runs"] = "outlast.runs"
    version: Literal[1] = VERSION
    storage: str
    runs: list[RunSummary]


class RunDocument(msgspec.Struct, kw_only=True):
    """`outlast runs STORAGE_PATH NAME --json`: one run's whole history (its run-state file)."""

    kind: Literal["outlast.run"] = "outlast.run"
    version: Literal[2] = RUN_VERSION
    location: str  # {storage_path}/{name}
    run: RunState
    # Of the wall time the run held its workers, the seconds of each part (docs/guide/watching.md); it carries a
    # version of its own. Additive under run version 2: None when the reports could not be read.
    goodput: Goodput | None = None


class LogsDocument(msgspec.Struct, kw_only=True):
    """`outlast runs STORAGE_PATH NAME --logs RANK --json`: a rank's last output lines."""

    kind: Literal["outlast.logs"] = "outlast.logs"
    version: Literal[1] = VERSION
    run: str
    rank: int
    attempt: int
    node_id: str
    path: str
    lines: list[str]


DOCUMENTS: dict[str, type] = {"status": StatusDocument, "runs": RunsDocument, "run": RunDocument,
                              "logs": LogsDocument}


def to_json(doc: msgspec.Struct) -> str:
    # Metrics that are NaN or infinite go by name, as on storage (docs/json.md).
    return msgspec.json.format(msgspec.json.encode(stored(msgspec.to_builtins(doc))), indent=2).decode()


def version_of(name: str) -> int:
    return RUN_VERSION if name == "run" else VERSION


def schema(name: str) -> dict:
    cls = DOCUMENTS[name]
    out = msgspec.json.schema(cls)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://outlast.invalid/schemas/{name}.v{version_of(name)}.json",
            "title": f"outlast {name} document, version {version_of(name)}", **out}


def schema_file(name: str) -> str:
    return f"{name}.v{version_of(name)}.json"


def write_schemas(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in DOCUMENTS:
        path = directory / schema_file(name)
        path.write_text(json.dumps(schema(name), indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    for p in write_schemas(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/schemas")):
        print(p)
