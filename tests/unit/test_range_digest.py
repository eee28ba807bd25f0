import os
import random
import threading

import pytest
import xxhash

from outlast.storage.range_digest import PrefixCursor, RangeDigest


def test_the_prefix_grows_only_when_the_ranges_before_it_have_landed_and_says_what_joined_it_in_order():
    c = PrefixCursor(100)
    assert c.land(30, 60) == []  # a gap at [0, 30)
    assert c.land(60, 100) == []
    assert c.prefix == 0 and not c.complete
    assert c.land(0, 10) == [(0, 10)]
    assert c.prefix == 10 and not c.complete  # [10, 30) still missing
    assert c.land(10, 30) == [(10, 30), (30, 60), (60, 100)]
    assert c.prefix == 100 and c.complete


def test_a_file_left_with_a_gap_is_never_complete():
    c = PrefixCursor(30)
    c.land(0, 10)
    c.land(20, 30)
    assert c.prefix == 10 and not c.complete


def test_an_empty_file_is_complete_before_any_range():
    assert PrefixCursor(0).complete


@pytest.mark.parametrize("start,end", [(0, 10), (5, 15), (25, 35), (20, 40), (28, 29)])
def test_a_range_landing_again_or_over_bytes_that_landed_is_refused(start, end):
    c = PrefixCursor(100)
    c.land(0, 10)
    c.land(20, 40)  # past a gap
    with pytest.raises(ValueError, match="overlaps bytes that landed before"):
        c.land(start, end)
    assert c.prefix == 10
    assert c.land(10, 20) == [(10, 20), (20, 40)]  # the refusal changed nothing


@pytest.mark.parametrize("start,end", [(-1, 5), (5, 5), (7, 3), (90, 101)])
def test_a_range_that_is_empty_or_outside_the_file_is_refused(start, end):
    with pytest.raises(ValueError, match="is not a range of a file of 100 bytes"):
        PrefixCursor(100).land(start, end)


def _ranges(size, part):
    return [(s, min(s + part, size)) for s in range(0, size, part)]


@pytest.mark.parametrize("hold", [1 << 30, 3000, 0], ids=["all-held", "some-read-back", "all-read-back"])
def test_ranges_landing_in_any_order_give_the_digest_of_the_file_in_order(tmp_path, hold):
    """Buffers past the bound on what is held are hashed from the written file's pages instead."""
    data = os.urandom(10_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    ranges = _ranges(len(data), 1000)
    random.Random(7).shuffle(ranges)
    d = RangeDigest(path, len(data), hold=hold)
    for start, end in ranges[:-1]:
        d.landed(start, end, data[start:end])
        assert d.hexdigest() is None  # not every range has landed
    d.landed(*ranges[-1], data[ranges[-1][0]:ranges[-1][1]])
    assert d.hexdigest() == xxhash.xxh3_128(data).hexdigest()


def test_ranges_landing_from_many_threads_at_once_give_the_digest_of_the_file(tmp_path):
    data = os.urandom(1 << 20)
    path = tmp_path / "f"
    path.write_bytes(data)
    ranges = _ranges(len(data), 4096)
    random.Random(3).shuffle(ranges)
    d = RangeDigest(path, len(data), hold=64 << 10)
    go = threading.Barrier(8)

    def land(share):
        go.wait()
        for start, end in share:
            d.landed(start, end, memoryview(data)[start:end])

    threads = [threading.Thread(target=land, args=(ranges[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert d.hexdigest() == xxhash.xxh3_128(data).hexdigest()


def test_a_range_whose_landed_bytes_differ_from_the_file_gives_a_digest_that_differs(tmp_path):
    data = os.urandom(4000)
    path = tmp_path / "f"
    path.write_bytes(data)
    d = RangeDigest(path, len(data))
    d.landed(2000, 4000, data[2000:])
    d.landed(0, 2000, b"\0" + data[1:2000])
    assert d.hexdigest() not in (None, xxhash.xxh3_128(data).hexdigest())


def test_a_file_cut_short_under_the_download_gives_no_digest(tmp_path):
    """A range to read back that the file no longer holds: the digest is unknown, not taken of fewer bytes."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1000))
    d = RangeDigest(path, 2000)
    d.landed(1000, 2000, None)
    d.landed(0, 1000, None)
    assert d.hexdigest() is None


def test_a_range_landing_twice_is_refused_and_the_digest_stays_right(tmp_path):
    data = os.urandom(3000)
    path = tmp_path / "f"
    path.write_bytes(data)
    d = RangeDigest(path, len(data))
    d.landed(0, 1000, data[:1000])
    with pytest.raises(ValueError, match="overlaps"):
        d.landed(0, 1000, data[:1000])
    d.landed(1000, 3000, data[1000:])
    assert d.hexdigest() == xxhash.xxh3_128(data).hexdigest()
