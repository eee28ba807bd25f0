"""A checkpoint's metadata is a small JSON dict in its own directory: read bounded, and anything else
there is refused with the file's name, never loaded whole or taken for metadata."""

from __future__ import annotations

import pytest

from outlast.storage import records as r
from outlast.train import Checkpoint


def test_metadata_round_trips_and_a_checkpoint_without_any_has_an_empty_dict(tmp_path):
    c = Checkpoint(str(tmp_path))
    assert c.get_metadata() == {}
    c.set_metadata({"epoch": 3})
    c.update_metadata({"loss": 0.5})
    assert c.get_metadata() == {"epoch": 3, "loss": 0.5}


@pytest.mark.parametrize("content, says", [(b"[1, 2]", "holds a list"), (b"{not json", "is not JSON")])
def test_metadata_that_is_not_a_json_dict_is_refused_naming_the_file(tmp_path, content, says):
    (tmp_path / ".metadata.json").write_bytes(content)
    with pytest.raises(ValueError, match=says) as e:
        Checkpoint(str(tmp_path)).get_metadata()
    assert ".metadata.json" in str(e.value)


def test_metadata_past_the_bound_is_not_read_whole(tmp_path):
    with open(tmp_path / ".metadata.json", "wb") as f:
        f.truncate(r.MAX_DOCUMENT_BYTES + 1)  # sparse: no disk spent
    with pytest.raises(r.DocumentTooLarge):
        Checkpoint(str(tmp_path)).get_metadata()
