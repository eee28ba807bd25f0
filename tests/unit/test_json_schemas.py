"""The committed JSON Schemas (docs/schemas/) are the ones the document types generate: a change
to a document changes its schema in the same commit, where a reviewer sees it."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from outlast.cli.documents import DOCUMENTS, RunsDocument, RunSummary, schema, schema_file, to_json

SCHEMAS = Path(__file__).resolve().parents[2] / "docs" / "schemas"


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_the_committed_schema_is_the_generated_one(name):
    committed = json.loads((SCHEMAS / schema_file(name)).read_text())
    assert committed == json.loads(json.dumps(schema(name))), \
        f"run `python -m outlast.cli.documents docs/schemas` and review the change to {schema_file(name)}"
    jsonschema.Draft202012Validator.check_schema(committed)


def test_a_document_of_another_version_or_kind_is_refused():
    validator = jsonschema.Draft202012Validator(json.loads((SCHEMAS / "runs.v1.json").read_text()))
    doc = json.loads(to_json(RunsDocument(storage="/x", runs=[RunSummary(name="a", status="finished")])))
    validator.validate(doc)
    validator.validate({**doc, "a_field_added_later": 1})  # additive changes keep the version
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({**doc, "version": 2})
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({**doc, "kind": "outlast.status"})
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({**doc, "runs": [{"status": "finished"}]})  # a run without its name
