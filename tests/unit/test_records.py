import json

import pytest

from outlast.protocol.messages import FileEntry
from outlast.storage import records as r


def manifest() -> r.Manifest:
    return r.Manifest(checkpoint_dir="checkpoint_001_000002", seq=3, attempt=1, report_index=2,
                      committed_at=12.5, ranks=[0, 1], files=[FileEntry("a/b.pt", 10, xxh3_128="ab" * 16)],
                      metrics={"loss": 0.25, "tags": ["x"]})


def run_state() -> r.RunState:
    failure = r.FailureRecord(attempt=1, rank=1, node_id="n", pid=9, exit_code=None, signal=9, time=3.0)
    return r.RunState(
        name="run", status="running", created_at=1.0, updated_at=2.0,
        attempts=[r.AttemptRecord(attempt=1, started_at=1.0, failures=[failure])],
        failure_counts={"worker": 1},
        checkpoints=[r.CheckpointRecord(checkpoint_dir="c", seq=1, attempt=1, report_index=0, committed_at=2.0)],
        latest_checkpoint="c",
    )


@pytest.mark.parametrize("doc", [manifest(), run_state()], ids=["manifest", "run_state"])
def test_a_document_survives_a_round_trip_through_json(doc):
    data = r.encode(doc)
    assert json.loads(data)["version"] == (r.MANIFEST_VERSION if isinstance(doc, r.Manifest) else r.RUN_STATE_VERSION)
    assert r.decode(data, type(doc), "somewhere") == doc


def test_encoded_documents_are_indented_for_people_to_read():
    assert b"\n  " in r.encode(run_state())


@pytest.mark.parametrize("data", [b"{not json", b"[]", b'{"name": "run"}', b""])
def test_a_corrupt_document_raises_corrupt_document_naming_the_path(data):
    with pytest.raises(r.CorruptDocument, match="/runs/x/run_state.json is not a valid RunState document"):
        r.decode(data, r.RunState, "/runs/x/run_state.json")


def test_a_corrupt_document_is_a_value_error():
    assert issubclass(r.CorruptDocument, ValueError)


def test_a_newer_schema_version_is_refused_naming_the_path_and_the_version():
    doc = json.loads(r.encode(manifest()))
    doc["version"] = r.MANIFEST_VERSION + 1
    with pytest.raises(r.NewerVersionError, match=r"/m\.json has schema version 3, written by a newer outlast; "
                                                  r"this outlast \(.+\) reads versions up to 2"):
        r.decode(json.dumps(doc).encode(), r.Manifest, "/m.json")


# What outlast wrote before manifests had version 2: sha256 for every file.
VERSION_1_MANIFEST = b"""{
  "version": 1, "checkpoint_dir": "checkpoint_001_000002", "seq": 3, "attempt": 1, "report_index": 2,
  "committed_at": 12.5, "ranks": [0],
  "files": [{"path": "model.pt", "size": 5,
             "sha256": "f572d396fae9206628714fb2ce00f72e94f2258f2b5ad4a4d5f1b4a8c2b0b2f1"}],
  "metrics": {}
}"""


def test_a_version_1_manifest_still_decodes_with_its_sha256_checksums():
    got = r.decode(VERSION_1_MANIFEST, r.Manifest, "/old.json")
    assert got.version == 1
    assert got.files[0].checksum == ("sha256", "f572d396fae9206628714fb2ce00f72e94f2258f2b5ad4a4d5f1b4a8c2b0b2f1")


def test_a_new_manifest_writes_xxh3_and_no_empty_sha256_field():
    doc = json.loads(r.encode(manifest()))
    assert doc["files"] == [{"path": "a/b.pt", "size": 10, "xxh3_128": "ab" * 16}]


def test_an_entry_without_any_checksum_says_which_file():
    with pytest.raises(ValueError, match="'x.pt' has no checksum"):
        _ = FileEntry("x.pt", 1).checksum


def test_a_newer_schema_with_changed_fields_is_still_reported_as_newer():
    doc = json.loads(r.encode(run_state()))
    doc["version"] = r.RUN_STATE_VERSION + 1
    del doc["created_at"]
    with pytest.raises(r.NewerVersionError, match="written by a newer outlast"):
        r.decode(json.dumps(doc).encode(), r.RunState, "/run_state.json")


def test_unknown_fields_are_ignored_so_additions_stay_readable():
    doc = json.loads(r.encode(manifest()))
    doc["added_later"] = 1
    assert r.decode(json.dumps(doc).encode(), r.Manifest, "m") == manifest()


def test_a_document_without_a_version_reads_as_the_current_version():
    doc = json.loads(r.encode(manifest()))
    del doc["version"]
    assert r.decode(json.dumps(doc).encode(), r.Manifest, "m").version == r.MANIFEST_VERSION
