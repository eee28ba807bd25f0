"""An asynchronous upload whose UploadDone is lost at its rank's exit: the controller looks for the files the
upload began with in storage itself, off its loop, and commits the checkpoint when they are all there."""

from __future__ import annotations

import logging

from outlast.controller import effects as fx
from outlast.controller.states import State
from outlast.protocol import messages as m
from outlast.storage.checksum import new_hasher
from tests.fakes.controller import make, start

NAME = "checkpoint_001_000000"


def hash_bytes(data: bytes) -> str:
    digest = new_hasher("xxh3_128")
    digest.update(data)
    return digest.hexdigest()


def async_report(h, rank, files: dict[str, bytes] | None):
    """`files` None: a staged save, whose files are not known when its report goes."""
    h.worker(m.Report(attempt=1, rank=rank, index=0, metrics={"step": 7}, checkpoint_dir=NAME, upload_pending=True,
                      upload_files=[m.FileEntry(path=p, size=len(b)) for p, b in (files or {}).items()]))


def run_to_the_end(h, placement, uploads: dict[int, dict[str, bytes] | None], stored: dict[str, bytes]):
    """The ranks in `uploads` report their upload, the others a report without a checkpoint; the uploads
    write `stored`, and every rank exits cleanly without its UploadDone."""
    for rank in placement:
        if rank in uploads:
            async_report(h, rank, uploads[rank])
        else:
            h.worker(m.Report(attempt=1, rank=rank, index=0, metrics={"step": 7}))
    for path, data in stored.items():
        h.core.book.store.storage.write_atomic(f"run/{NAME}/{path}", data)
    for rank, node_id in placement.items():
        h.worker(m.WorkerDone(attempt=1, rank=rank, reports=1))
        h.agent(node_id, h.exited(rank, node_id))


def test_a_rank_that_exits_without_its_upload_done_has_its_checkpoint_committed_when_storage_holds_its_files():
    h = make()
    placement = start(h)
    files = {"model.pt": b"weights", "opt/state.pt": b"optimizer state"}
    h.hold_storage = True
    run_to_the_end(h, placement, {0: files}, files)
    assert h.state is State.FINISHING  # not finished while storage is asked
    checks = [e for e in h.held if isinstance(e, fx.CheckUploads)]
    assert [(e.checkpoint_dir, e.files) for e in checks] == [(NAME, (("model.pt", 7), ("opt/state.pt", 15)))]
    h.step(dt=10.0)  # far past the wait for the last messages: a check under way is waited for
    assert h.state is State.FINISHING
    while h.held:
        h.release(h.held[0])
    assert h.state is State.FINISHED
    assert h.core.book.state.latest_checkpoint == NAME
    manifest = h.core.book.store.read_manifest(NAME)
    assert manifest is not None and manifest.metrics == {"step": 7}
    assert {f.path: f.checksum for f in manifest.files} == {p: ("xxh3_128", hash_bytes(b)) for p, b in files.items()}


def test_a_file_missing_or_of_another_size_keeps_the_checkpoint_uncommitted_saying_which(caplog):
    for stored, why in (({"model.pt": b"weights"}, "opt/state.pt: not in storage"),
                        ({"model.pt": b"weigh", "opt/state.pt": b"optimizer state"},
                         "model.pt: 5 bytes in storage, 7 when the upload began")):
        h = make()
        placement = start(h)
        with caplog.at_level(logging.ERROR, logger="outlast.controller"):
            caplog.clear()
            run_to_the_end(h, placement, {0: {"model.pt": b"weights", "opt/state.pt": b"optimizer state"}}, stored)
        assert h.state is State.FINISHED and h.core.book.state.latest_checkpoint is None
        said = " ".join(r.getMessage() for r in caplog.records)
        assert f"checkpoint {NAME} not committed" in said and "rank 0 exited before its asynchronous upload" in said
        assert why in said


def test_an_upload_done_that_comes_after_all_commits_the_checkpoint_once():
    h = make()
    placement = start(h)
    files = {"model.pt": b"weights"}
    h.hold_storage = True
    run_to_the_end(h, placement, {0: files}, files)
    entry = m.FileEntry(path="model.pt", size=7, xxh3_128=hash_bytes(b"weights"))
    h.worker(m.UploadDone(attempt=1, rank=0, index=0, checkpoint_dir=NAME, files=[entry]))
    while h.held:
        h.release(h.held[0])
    assert h.state is State.FINISHED and h.core.book.state.latest_checkpoint == NAME
    assert len([e for e in h.storage_log if isinstance(e, fx.WriteManifest)]) == 1


def test_a_staged_save_whose_files_were_not_known_when_it_began_is_not_committed_saying_why(caplog):
    h = make()
    placement = start(h)
    with caplog.at_level(logging.WARNING, logger="outlast.controller"):
        run_to_the_end(h, placement, {0: None, 1: None}, {"model.pt": b"weights"})
        h.step(dt=10.0)
    assert h.state is State.FINISHED and h.core.book.state.latest_checkpoint is None
    assert not [e for e in h.storage_log if isinstance(e, fx.CheckUploads)]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"these checkpoints are not committed: {NAME} of ranks [0, 1]" in said


def test_a_rank_that_failed_is_not_looked_for():
    h = make(max_failures=1)
    placement = start(h)
    async_report(h, 0, {"model.pt": b"weights"})
    h.agent(placement[0], h.exited(0, placement[0], code=1))
    assert not [e for e in h.storage_log if isinstance(e, fx.CheckUploads)]
