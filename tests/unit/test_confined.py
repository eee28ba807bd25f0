"""Opening a file a document names: relative, inside its root, no link followed, a regular file,
and read within a bound."""

from __future__ import annotations

import os

import pytest

from outlast.cli.confined import Refused, open_under, read_at_most, tail_lines


def test_a_plain_file_under_the_root_opens_and_anything_else_is_refused(tmp_path):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "f.log").write_text("x")
    (tmp_path / "outside").write_text("secret")
    (root / "a" / "link").symlink_to(tmp_path / "outside")
    (root / "inner-link").symlink_to(root / "a")
    os.mkfifo(root / "a" / "fifo")
    os.close(open_under(root, "a/f.log"))
    for rel in ["", "/a/f.log", "a/../a/f.log", "a//f.log", "./a/f.log", "a/f.log\x00", "../outside"]:
        with pytest.raises(Refused, match="not a relative path"):
            open_under(root, rel)
    for rel in ["a/link", "inner-link/f.log"]:
        with pytest.raises(Refused, match="links are not followed"):
            open_under(root, rel)
    with pytest.raises(Refused, match="not a regular file"):
        open_under(root, "a/fifo")  # opened without waiting for a writer, then refused
    with pytest.raises(Refused, match="not a regular file"):
        open_under(root, "a")
    with pytest.raises(FileNotFoundError):
        open_under(root, "a/missing.log")


def test_reads_stop_at_their_bound(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"".join(b"line %d\n" % i for i in range(100_000)))
    fd = os.open(f, os.O_RDONLY)
    try:
        assert len(read_at_most(fd, 10)) == 11
        assert tail_lines(fd, 3, 1 << 20) == (["line 99997", "line 99998", "line 99999"], False)
        lines, cut = tail_lines(fd, 100_000, 100)  # the bound reached before the lines asked for
        assert cut and lines[-1] == "line 99999" and sum(len(x) + 1 for x in lines) <= 100
        assert tail_lines(fd, 0, 100) == ([], False)
    finally:
        os.close(fd)
