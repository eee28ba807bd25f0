"""The memory tier's pages: a copy received is written into the pages of a copy that went (within the budget),
its seals opened straight into them, its checksum taken as it comes; a chunk that fails its seal ends its
transfer whichever way it was written."""

import os
import threading
import time
from pathlib import Path

import pytest

from outlast.agent.tier_answers import TierAnswers
from outlast.agent.tier_client import ASKER, TAG, TransferError, TransferSealer, new_transfer, open_landing
from outlast.agent.tier_schedule import Transfers
from outlast.protocol import messages as m
from outlast.protocol.transport import TIER_REQUESTS
from outlast.storage import safepath
from outlast.storage.checksum import hash_file
from outlast.storage.memtier import CopyKey
from outlast.storage.tier_store import TierStore, copy_dir

MB = 2**20
RUN = "run"


def entry_of(path: Path, name: str) -> m.FileEntry:
    return m.FileEntry(path=name, size=path.stat().st_size, xxh3_128=hash_file(path)[1])


def tier(tmp_path: Path, budget: int) -> TierStore:
    s = TierStore(tmp_path / "tier", "n1", budget)
    s.open()
    return s


class Peer:
    """What sends a copy to a tier server's answers: its offer, its sealed chunks, its end; as tier_client.push
    does, without the sockets."""

    def __init__(self, answers: TierAnswers) -> None:
        self.answers = answers

    def offer(self, checkpoint_dir: str, seq: int, files: list[m.FileEntry]) -> m.Transfer:
        ack = self.answers.request(b"peer", m.TierOffer(run=RUN, checkpoint_dir=checkpoint_dir, rank=0, seq=seq,
                                                        files=files, primary=False), time.monotonic())
        assert isinstance(ack, m.TierAck) and ack.transfer is not None, ack
        return ack.transfer

    def chunk(self, sealer: TransferSealer, checkpoint_dir: str, path: str, offset: int, data: bytes,
              spoil: bool = False) -> m.TierReply:
        head, sealed = sealer.seal(m.TierChunk(run=RUN, checkpoint_dir=checkpoint_dir, rank=0, path=path,
                                               offset=offset), data)
        if spoil:
            sealed = bytearray(sealed)
            sealed[len(sealed) // 2] ^= 1
        reply = self.answers.data(TIER_REQUESTS.decode(head), head, bytes(sealed),
                                  time.monotonic())
        assert not isinstance(reply, list)
        return reply

    def send(self, checkpoint_dir: str, seq: int, files: dict[str, bytes]) -> m.TierReply:
        entries = [m.FileEntry(path=p, size=len(b), xxh3_128=_xxh(b)) for p, b in files.items()]
        sealer = TransferSealer(self.offer(checkpoint_dir, seq, entries), ASKER)
        for path, data in files.items():
            for offset in range(0, len(data), MB):
                assert isinstance(self.chunk(sealer, checkpoint_dir, path, offset, data[offset:offset + MB]),
                                  m.TierAck)
        return self.answers.request(b"peer", m.TierOfferEnd(run=RUN, checkpoint_dir=checkpoint_dir, rank=0),
                                    time.monotonic())


def _xxh(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_128(data).hexdigest()


@pytest.fixture
def server(tmp_path):
    store = tier(tmp_path, budget=5 * MB)  # one copy of 3 MiB held, and room for the next one's declared bytes
    answers = TierAnswers(store, threading.Lock(), Transfers("n1", 60.0), "tcp://127.0.0.1:1")
    yield store, Peer(answers)
    answers.close()


def inode(store: TierStore, checkpoint_dir: str, path: str) -> int:
    return (copy_dir(store.root, "n1", CopyKey(RUN, checkpoint_dir, 0)) / path).stat().st_ino


def hold(store: TierStore, checkpoint_dir: str, path: str) -> int:
    """A descriptor of a copy's file, open while a test asks whether its pages are written over: what it reads
    afterwards says which bytes that very file holds (an inode number alone can be a new file's, once the old
    one is gone)."""
    return os.open(copy_dir(store.root, "n1", CopyKey(RUN, checkpoint_dir, 0)) / path, os.O_RDONLY)


def within_budget(store: TierStore) -> bool:
    return store.book.used() + store.spare_bytes() <= store.book.budget_bytes


def test_a_copy_received_is_written_into_the_pages_of_the_copy_it_evicts_and_checked(server):
    store, peer = server
    first = {"model.pt": os.urandom(3 * MB)}
    assert peer.send("c1", 1, first).ok
    held = hold(store, "c1", "model.pt")

    second = {"model.pt": os.urandom(3 * MB)}
    assert peer.send("c2", 2, second).ok
    # c1 went to make room for c2, and c2's file is c1's, its pages written over in place.
    assert store.record(CopyKey(RUN, "c1", 0)) is None
    assert os.pread(held, 3 * MB, 0) == second["model.pt"] and os.fstat(held).st_ino == inode(store, "c2", "model.pt")
    os.close(held)
    assert (copy_dir(store.root, "n1", CopyKey(RUN, "c2", 0)) / "model.pt").read_bytes() == second["model.pt"]
    assert store.verify(CopyKey(RUN, "c2", 0)) is None and within_budget(store)

    # A copy whose file is larger than the spare one: the spare's pages are its start, the rest made anew.
    third = {"model.pt": os.urandom(3 * MB + 12345), "small": b"tail"}
    assert peer.send("c3", 3, third).ok
    for name, data in third.items():
        assert (copy_dir(store.root, "n1", CopyKey(RUN, "c3", 0)) / name).read_bytes() == data
    assert within_budget(store)


def test_spare_pages_stay_within_the_budget_and_go_when_the_run_is_freed(server):
    store, peer = server
    assert peer.send("c1", 1, {"model.pt": os.urandom(3 * MB)}).ok
    store.drop(CopyKey(RUN, "c1", 0))
    assert store.spare_bytes() == 3 * MB and store.book.used() == 0 and within_budget(store)
    # A copy that needs the room takes the spare pages first: a smaller one, then the rest go as the budget says.
    assert peer.send("c2", 2, {"model.pt": os.urandom(MB)}).ok
    assert store.spare_bytes() == 0 and within_budget(store)
    store.free_run(RUN)
    assert store.spare_bytes() == 0 and not list((store.home / "spare").glob("*"))


def test_pages_a_restore_linked_or_an_upload_reads_are_not_written_over(server, tmp_path):
    store, peer = server
    first, second = os.urandom(3 * MB), os.urandom(3 * MB)
    assert peer.send("c1", 1, {"model.pt": first}).ok
    linked = hold(store, "c1", "model.pt")
    # A restore's link, made and removed: the pages may still be mapped by the rank that read them.
    link = tmp_path / "restore-link"
    os.link(copy_dir(store.root, "n1", CopyKey(RUN, "c1", 0)) / "model.pt", link)
    link.unlink()
    assert peer.send("c2", 2, {"model.pt": second}).ok
    assert os.pread(linked, 3 * MB, 0) == first and store.spare_bytes() == 0
    os.close(linked)

    # A copy being uploaded (read off the lock) when it goes: its pages are not kept either.
    read = hold(store, "c2", "model.pt")
    store.reading(CopyKey(RUN, "c2", 0), 1)
    assert peer.send("c3", 3, {"model.pt": os.urandom(3 * MB)}).ok
    assert os.pread(read, 3 * MB, 0) == second
    os.close(read)
    store.reading(CopyKey(RUN, "c2", 0), -1)


@pytest.mark.parametrize("reused", [False, True])
def test_a_chunk_that_fails_its_seal_ends_the_transfer_and_nothing_of_it_is_kept(server, reused):
    store, peer = server
    if reused:  # the chunks then open straight into the map of the spare file's pages
        assert peer.send("c0", 1, {"model.pt": os.urandom(3 * MB)}).ok
    data = os.urandom(3 * MB)
    files = [m.FileEntry(path="model.pt", size=len(data), xxh3_128=_xxh(data))]
    sealer = TransferSealer(peer.offer("c1", 2, files), ASKER)
    carrier = peer.answers.transfers.all()[0].carrier
    assert carrier.landings["model.pt"].mapped is reused
    assert isinstance(peer.chunk(sealer, "c1", "model.pt", 0, data[:MB]), m.TierAck)
    refused = peer.chunk(sealer, "c1", "model.pt", MB, data[MB:2 * MB], spoil=True)
    assert isinstance(refused, m.TierStored) and not refused.ok and "failed its seal" in refused.reason
    # The transfer is over: what it wrote went, with its bytes in the budget, and no later chunk is taken.
    assert not store.writing(CopyKey(RUN, "c1", 0)) and peer.answers.transfers.all() == []
    later = peer.chunk(sealer, "c1", "model.pt", 2 * MB, data[2 * MB:])
    assert isinstance(later, m.TierStored) and not later.ok
    end = peer.answers.request(b"peer", m.TierOfferEnd(run=RUN, checkpoint_dir="c1", rank=0), time.monotonic())
    assert isinstance(end, m.TierStored) and not end.ok
    assert store.record(CopyKey(RUN, "c1", 0)) is None and within_budget(store)


def test_a_landing_writes_only_inside_its_file_and_opens_only_whole_seals(tmp_path):
    transfer = new_transfer("tcp://127.0.0.1:1")
    sender, receiver = TransferSealer(transfer, ASKER), TransferSealer(transfer, 1)
    (tmp_path / "spare").write_bytes(os.urandom(2 * MB))  # pages there already: mapped
    for name, mapped in (("spare", True), ("new", False)):
        landing = open_landing(tmp_path, m.FileEntry(path=name, size=2 * MB, xxh3_128="0" * 32))
        try:
            assert landing.mapped is mapped
            data = os.urandom(MB)
            chunk = m.TierChunk(run=RUN, checkpoint_dir="c", rank=0, path=name, offset=MB)
            head, sealed = sender.seal(chunk, data)
            seen: list[bytes] = []
            landing.put(receiver, head, TIER_REQUESTS.decode(head), sealed, bytearray(MB),
                        lambda b, into=seen: into.append(bytes(b)))
            assert seen == [data]  # what is hashed is what the file now holds
            past = m.TierChunk(run=RUN, checkpoint_dir="c", rank=0, path=name, offset=MB + 1)
            with pytest.raises(TransferError, match="outside"):
                landing.put(receiver, head, past, sealed, bytearray(MB), seen.append)
            with pytest.raises(TransferError, match="outside"):
                landing.put(receiver, head, chunk, sealed[:TAG - 1], bytearray(MB), seen.append)
            assert len(seen) == 1
        finally:
            landing.close()
        assert (tmp_path / name).read_bytes()[MB:] == data and (tmp_path / name).stat().st_size == 2 * MB


def test_a_file_kept_for_its_pages_is_written_over_only_when_it_is_ours_alone(tmp_path):
    (tmp_path / "mine").write_bytes(b"old bytes")
    ino = (tmp_path / "mine").stat().st_ino
    fd = safepath.open_under(tmp_path, "mine", write=True, keep=True)
    os.close(fd)
    assert (tmp_path / "mine").stat().st_ino == ino  # written over in place
    os.link(tmp_path / "mine", tmp_path / "other-link")
    fd = safepath.open_under(tmp_path, "mine", write=True, keep=True)
    os.close(fd)
    assert (tmp_path / "mine").stat().st_ino != ino and (tmp_path / "other-link").read_bytes() == b"old bytes"
    os.symlink(tmp_path / "other-link", tmp_path / "sym")
    fd = safepath.open_under(tmp_path, "sym", write=True, keep=True)
    os.close(fd)
    assert not (tmp_path / "sym").is_symlink() and (tmp_path / "other-link").read_bytes() == b"old bytes"


@pytest.mark.parametrize("spare", [False, True])
def test_a_ranks_file_copied_in_is_checked_by_the_checksum_of_what_was_written(tmp_path, spare):
    from outlast.agent.tier_client import CHUNK, copy_checked

    src = tmp_path / "rank"
    src.mkdir()
    data = os.urandom(CHUNK + 4321)
    (src / "model.pt").write_bytes(data)
    entry = entry_of(src / "model.pt", "model.pt")
    where = tmp_path / "copy"
    where.mkdir()
    if spare:  # pages there already: copied straight into a map of them
        (where / "model.pt").write_bytes(os.urandom(2 * CHUNK))
    assert copy_checked(str(src), entry, where) == entry.xxh3_128
    assert (where / "model.pt").read_bytes() == data
    # A file whose size is not its record's is refused before a byte is copied.
    (src / "model.pt").write_bytes(data[:-1])
    with pytest.raises(ValueError, match="the record says"):
        copy_checked(str(src), entry, where)
    # Bytes that differ from the rank's checksum give another checksum: the store's check refuses the copy.
    (src / "model.pt").write_bytes(os.urandom(len(data)))
    assert copy_checked(str(src), entry, where) != entry.xxh3_128


def test_a_hold_copies_in_and_keeps_only_what_matches_its_checksums(tmp_path):
    from outlast.agent.tier_work import TierWork

    store = tier(tmp_path, budget=8 * MB)
    work = TierWork(None, None, store, threading.Lock(), lambda: None)  # no peer: no socket is made
    src = tmp_path / "rank"
    (src / "sub").mkdir(parents=True)
    (src / "model.pt").write_bytes(os.urandom(3 * MB))
    (src / "sub" / "opt.pt").write_bytes(b"")
    files = [entry_of(src / "model.pt", "model.pt"), entry_of(src / "sub" / "opt.pt", "sub/opt.pt")]
    hold = m.TierHold(run=RUN, checkpoint_dir="c1", rank=0, seq=1, files=files, source_dir=str(src))
    assert work.copy_in(hold) is None and store.verify(CopyKey(RUN, "c1", 0)) is None
    bad = [files[0], m.FileEntry(path="sub/opt.pt", size=0, xxh3_128="0" * 32)]
    why = work.copy_in(m.TierHold(run=RUN, checkpoint_dir="c2", rank=0, seq=2, files=bad, source_dir=str(src)))
    assert why is not None and "sub/opt.pt does not match its checksum" in why
    assert store.record(CopyKey(RUN, "c2", 0)) is None and not store.writing(CopyKey(RUN, "c2", 0))
