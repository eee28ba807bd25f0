"""What a SYNC report() waits for, read from the trace that every process of a real run writes
(`outlast/trace.py`, one O_APPEND line a mark, so the file's order is the order the marks were made):
each file is fsynced once placed, the directories after the files, then the controller writes the
manifest and tells the rank, and only then is the node asked for its copy into memory."""

from __future__ import annotations

import json
import os
import tempfile

from outlast import train
from outlast.train import Checkpoint, RunConfig, ScalingConfig, Trainer

FILES = ("a.bin", "b.bin", "sub/c.bin")


def _report_once(config: dict) -> None:
    with tempfile.TemporaryDirectory() as d:
        os.mkdir(os.path.join(d, "sub"))
        for name in FILES:
            with open(os.path.join(d, name), "wb") as f:
                f.write(os.urandom(1 << 20))
        train.report({"step": 1}, checkpoint=Checkpoint.from_directory(d))


def test_a_sync_reports_files_and_directories_are_fsynced_and_its_manifest_written_before_it_returns(
        storage_path, tmp_path, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("OUTLAST_TRACE_FILE", str(trace))
    monkeypatch.delenv("OUTLAST_ADDRESS", raising=False)
    result = Trainer(_report_once, scaling_config=ScalingConfig(num_workers=1),
                     run_config=RunConfig(name="sync-report", storage_path=storage_path)).fit()
    assert result.error is None and result.checkpoint is not None
    marks = [json.loads(line) for line in trace.read_text().splitlines()]

    def where(phase: str, **fields) -> list[int]:
        return [i for i, e in enumerate(marks) if e["phase"] == phase and all(e.get(k) == v for k, v in fields.items())]

    (begun,), (uploaded,), (returned,) = where("report.upload_begin"), where("report.uploaded"), where("report.committed")
    fsynced = {marks[i]["file"]: i for i in where("upload.fsynced")}
    assert sorted(fsynced) == sorted(os.path.basename(name) for name in FILES)
    (dirs,) = where("upload.dirs_fsynced")
    (manifest_begun,), (manifest_written,) = where("storage.begin", effect="WriteManifest"), \
        where("storage.end", effect="WriteManifest")
    (told,) = where("controller.committed")
    assert begun < max(fsynced.values()) < dirs < uploaded < manifest_begun < manifest_written < told < returned
    assert marks[dirs]["dirs"] == 3  # sub/, the checkpoint's and the run's, which holds the checkpoint's
    holds = where("tier.begin", kind="TierHold")
    assert holds and min(holds) > told  # the node's copy is asked for once the rank is told, not beside the commit
