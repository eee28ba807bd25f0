"""A notice's checkpoint goes first: other uploads' files wait while it is in progress."""

import concurrent.futures
import threading

import pytest

from outlast.storage import priority
from outlast.storage.local import LocalStorage


def _submit_from_another_thread(fn, *args):
    box = []
    t = threading.Thread(target=lambda: box.append(priority.submit(fn, *args)))
    t.start()
    t.join()
    return box[0]


def test_an_ordinary_upload_file_waits_until_the_urgent_upload_is_over():
    order = []
    with priority.urgent():
        assert priority.urgent_pending() == 1
        ordinary = _submit_from_another_thread(order.append, "ordinary")
        priority.submit(order.append, "urgent").result(timeout=30)
        with pytest.raises(concurrent.futures.TimeoutError):
            ordinary.result(timeout=0.3)
    ordinary.result(timeout=30)
    assert order == ["urgent", "ordinary"]
    assert priority.urgent_pending() == 0


def test_an_urgent_upload_runs_even_when_every_ordinary_worker_is_waiting(tmp_path):
    # Ordinary files held at the gate occupy their pool's threads; the urgent upload has its own.
    src = tmp_path / "src"
    src.mkdir()
    for i in range(64):
        (src / f"f{i}").write_bytes(bytes([i]) * 100)
    store = LocalStorage(tmp_path / "store")
    with priority.urgent():
        held = [_submit_from_another_thread(len, b"x") for _ in range(64)]
        entries = store.upload_dir(src, "jit")
        assert len(entries) == 64
    assert all(f.result(timeout=30) == 1 for f in held)


def test_urgency_belongs_to_the_thread_that_asked_for_it():
    seen = []
    with priority.urgent():
        t = threading.Thread(target=lambda: seen.append(priority.is_urgent()))
        t.start()
        t.join()
        seen.append(priority.is_urgent())
    assert seen == [False, True] and not priority.is_urgent()
