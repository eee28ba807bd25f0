"""`outlast status --json` (on the head and on a member) and `outlast runs ... --json` print
documents that validate against their committed schemas and say what happened."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from outlast.cli.documents import schema_file
from outlast.cli.main import main as cli_main
from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import counting_loop

SCHEMAS = Path(__file__).resolve().parents[2] / "docs" / "schemas"


def _json(capsys, name: str, *argv: str) -> tuple[int, dict]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli_main(list(argv))
    doc = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator(json.loads((SCHEMAS / schema_file(name)).read_text())).validate(doc)
    return exited.value.code, doc


def test_status_and_runs_print_documents_that_validate(tmp_path, capsys, monkeypatch):
    storage = str(tmp_path / "storage")
    with LocalCluster(num_nodes=2, node_timeout_s=3) as cluster:
        Trainer(counting_loop,
                train_loop_config={"events": str(tmp_path / "events"), "steps": 12, "every": 5,
                                   "fault": {"when": "after_report", "step": 7, "rank": 1, "kind": "kill"}},
                scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(name="documented", storage_path=storage,
                                     failure_config=FailureConfig(max_failures=1))).fit()

        code, head = _json(capsys, "status", "status", "--json")
        assert code == 0 and head["kind"] == "outlast.status" and head["role"] == "head"
        assert head["node"]["node_id"] == "node-0" and head["node"]["zygote_ready"] in (True, False)
        assert sorted(n["node_id"] for n in head["nodes"]) == ["node-0", "node-1"]

        monkeypatch.setenv("OUTLAST_ADDRESS", cluster.nodes["node-1"].address)
        code, member = _json(capsys, "status", "status", "--json")
        assert code == 0 and member["role"] == "member" and member["head_answered"] is True
        assert member["head_address"] == cluster.head_address and len(member["nodes"]) == 2

        # the nodes' log directories go with the cluster: read a rank's lines while it stands
        code, logs = _json(capsys, "logs", "runs", storage, "documented", "--logs", "1", "--attempt", "1", "--json")
        assert code == 0 and logs["rank"] == 1 and logs["attempt"] == 1 and logs["node_id"].startswith("node-")
        assert isinstance(logs["lines"], list) and logs["path"].endswith("attempt1-rank1.log")

    code, runs = _json(capsys, "runs", "runs", storage, "--json")
    assert code == 0 and [r["name"] for r in runs["runs"]] == ["documented"]
    assert runs["runs"][0]["status"] == "finished" and runs["runs"][0]["attempts"] == 2
    assert runs["runs"][0]["failures"] == 1

    code, run = _json(capsys, "run", "runs", storage, "documented", "--json")
    assert code == 0 and run["run"]["name"] == "documented" and len(run["run"]["attempts"]) == 2
    assert {o["rank"] for o in run["run"]["attempts"][0]["outputs"]} == {0, 1}
    assert run["run"]["attempts"][0]["failures"][0]["rank"] == 1

