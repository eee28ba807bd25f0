import hashlib
import os
import tempfile
from pathlib import Path

import pytest
import xxhash

from outlast.storage.checksum import COPY_CHUNK, copy_file, copy_hashed, hash_file, new_hasher
from tests.fakes.files import rewritten


@pytest.mark.parametrize("size", [0, 1, 4 << 20, (4 << 20) + 7])
def test_hash_file_gives_the_size_and_the_libraries_digest(tmp_path, size):
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert hash_file(tmp_path / "f") == (size, xxhash.xxh3_128(data).hexdigest())
    assert hash_file(tmp_path / "f", "sha256") == (size, hashlib.sha256(data).hexdigest())


def test_an_unknown_algorithm_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'; this outlast knows xxh3_128, sha256"):
        new_hasher("md5")


def test_copy_file_copies_every_byte_and_replaces_an_older_target(tmp_path):
    data = os.urandom((3 << 20) + 11)
    (tmp_path / "src").write_bytes(data)
    (tmp_path / "dst").write_bytes(b"x" * (8 << 20))
    copy_file(tmp_path / "src", tmp_path / "dst")
    assert (tmp_path / "dst").read_bytes() == data


def test_in_order_digests_are_of_files_whose_chunks_all_came_in_order_and_nothing_else():
    from outlast.storage.checksum import InOrderDigests

    a, b, c = os.urandom(10), os.urandom(6), os.urandom(8)
    d = InOrderDigests({"a": ("xxh3_128", 10), "b": ("sha256", 6), "c": ("xxh3_128", 8), "empty": ("xxh3_128", 0),
                        "short": ("xxh3_128", 4)})
    d.update("a", 0, a[:4])
    d.update("a", 4, a[4:])
    d.update("b", 0, b)
    d.update("c", 4, c[4:])  # out of order: c is read again by whoever checks it
    d.update("c", 0, c[:4])
    d.update("short", 0, b"ab")  # never whole
    d.update("stranger", 0, b"x")  # no such file: ignored
    assert d.digests() == {"a": xxhash.xxh3_128(a).hexdigest(), "b": hashlib.sha256(b).hexdigest(),
                           "empty": xxhash.xxh3_128(b"").hexdigest()}
    d.update("a", 0, a)  # a chunk again, over what was written: a's digest is no longer known
    assert "a" not in d.digests()


def test_a_copy_written_behind_is_the_source_byte_for_byte_across_its_16_mib_steps(tmp_path):
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(os.urandom((40 << 20) + 3))  # two whole steps and a part of one
    copy_file(src, dst, write_behind=True)
    assert hash_file(dst) == hash_file(src)


@pytest.mark.parametrize("size", [0, 1, COPY_CHUNK, 3 * COPY_CHUNK + 5, (40 << 20) + 3],
                         ids=["empty", "one-byte", "one-chunk", "chunks-and-a-tail", "past-two-writeback-steps"])
@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_a_hashed_copy_is_the_source_byte_for_byte_with_hash_files_size_and_digest(tmp_path, size, algorithm):
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    data = os.urandom(size)
    src.write_bytes(data)
    dst.write_bytes(b"x" * (COPY_CHUNK + 9))  # an older, longer file there: cut, then written over
    assert copy_hashed(src, dst, write_behind=True, algorithm=algorithm) == hash_file(src, algorithm)
    assert dst.read_bytes() == data


def test_a_source_rewritten_during_its_copy_gets_the_digest_of_the_bytes_copied(tmp_path):
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    size = 16 * COPY_CHUNK
    src.write_bytes(bytes(size))
    with rewritten(src, COPY_CHUNK // 2):
        for _ in range(5):
            copied = copy_hashed(src, dst)
            assert copied == hash_file(dst) == (size, xxhash.xxh3_128(dst.read_bytes()).hexdigest())


def test_a_hashed_copy_from_another_file_system_is_sent_and_hashed_alike(tmp_path):
    # copy_file_range refuses two file systems (EXDEV): the chunks are sent (sendfile) instead.
    other = next((d for d in ("/dev/shm", "/var/tmp", "/tmp") if os.path.isdir(d)
                  and os.stat(d).st_dev != os.stat(tmp_path).st_dev), None)
    if other is None:
        pytest.skip("no second file system here to copy from")
    data = os.urandom(3 * COPY_CHUNK + 5)
    fd, name = tempfile.mkstemp(dir=other)
    try:
        os.write(fd, data)
        os.close(fd)
        assert copy_hashed(Path(name), tmp_path / "dst.bin") == hash_file(name)
        assert (tmp_path / "dst.bin").read_bytes() == data
    finally:
        os.unlink(name)
