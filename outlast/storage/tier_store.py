"""A node's memory tier on its files: checkpoint copies in /dev/shm, owned by the agent.

Why files in /dev/shm and not a memfd: tmpfs is RAM, and its files outlive the worker that
reported them and the agent that keeps them. A memfd dies with its last holder, so a
persistent agent restarted by systemd would come back to an empty tier, and every worker
would need the agent to pass it descriptors; a file is read in place by a restoring worker
of the same user, with the same checks as a file of `storage_path`. What a crashed agent
leaves is found again by the next one: its own node's copies are reclaimed (each one whole
or dropped), those of agents of this user that are gone are freed.

The agent's tier thread copies a rank's files in, so with isolation on their pages are
charged to the agent's cgroup (`system/`), whose `memory.low` counts the budget
(`outlast/isolation/reservations.py`), never to a workload's limit. A draining node links
them instead (`TierHold.link`): no copy while the deadline runs, on a node that is going
away, and their pages stay charged where the rank wrote them.

Layout under the root (`$OUTLAST_TIER_DIR`, else /dev/shm/outlast-<uid>):

    <node_id>/owner.json                        the agent that owns it (pid, start time, host)
    <node_id>/<run hash>/<checkpoint>/rank-R/   one rank's files of one checkpoint
    <node_id>/<run hash>/<checkpoint>/rank-R.json  its record, written last: a copy without one is partial
    <node_id>/<run hash>/<checkpoint>/rank-R.partial/  a copy being written: its bytes count in the budget
    <node_id>/restores/<run hash>/<checkpoint>/  links to held copies for a restore (tier_restore.py): they go
                                                 with the copies they link, so they pin nothing of their own
    <node_id>/spare/N                           pages kept for the next copy received (below)

Spare pages. Writing into tmpfs pages that already exist runs several times as fast as making new
ones (a chunk's seal opened straight into a map of existing pages at ~6 GB/s, against ~2 GB/s
written into new pages here, and 0.3-1.0 GB/s into pages the VM never used), so the files of a
copy that goes (evicted, dropped, or a transfer that failed) are kept as spare files, and a copy
copied in or received from a peer (`begin(reuse=True)`) is written into them, as Gemini writes into
buffers it allocated once. What the tier holds in pages stays within its budget: held copies, copies being
written and spare files together (spare files go, smallest first, whenever the other two need
their room; all of them when a run is freed). Only pages nobody else can see are kept: a file of
such a copy, with no other link, whose inode has not changed since the copy was kept (its ctime: a
restore's link, made or removed, changes it), and not being read off the lock (an upload, a
replica); anything else is removed as before.

Decisions (what fits, what is evicted) are `outlast/storage/memtier.py`'s; this module only does
them. Not thread-safe: one thread owns a store.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import msgspec

from outlast.identity import ProcessIdentity, host_id, still_running, this_process
from outlast.protocol import paths
from outlast.protocol.messages import FileEntry
from outlast.statedir import private_dir
from outlast.storage import safepath
from outlast.storage.memtier import Admission, Copy, CopyKey, TierBook

_PARTIAL = ".partial"
_SPARE = "spare"
_SPARE_MIN = 1 << 20  # smaller files are made anew: their pages are not worth a file to keep them


class TierRecord(msgspec.Struct, frozen=True, kw_only=True):
    run: str
    checkpoint_dir: str
    rank: int
    seq: int
    files: list[FileEntry]
    stored_at: float
    primary: bool = True
    committed: bool = False

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)  # a record on disk is data: it names its own directory

    @property
    def key(self) -> CopyKey:
        return CopyKey(self.run, self.checkpoint_dir, self.rank)

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def copy(self) -> Copy:
        return Copy(self.key, self.seq, self.nbytes, self.stored_at, self.primary, self.committed)


class _Owner(msgspec.Struct, frozen=True):
    process: ProcessIdentity
    host: str


def default_root() -> Path:
    return Path(os.environ.get("OUTLAST_TIER_DIR") or f"/dev/shm/outlast-{os.geteuid()}")


def run_dir_name(run: str) -> str:
    return hashlib.sha1(run.encode()).hexdigest()[:16]


def copy_dir(root: Path, node_id: str, key: CopyKey) -> Path:
    """Where the files of `key` lie on node `node_id` (a restoring worker reads them there)."""
    return safepath.child(root, node_id, run_dir_name(key.run), key.checkpoint_dir, f"rank-{key.rank}")


def os_failure(node_id: str, root: Path, e: OSError) -> str:
    """What a file operation of the tier that failed says: the node, the path, the error and, for a full file
    system, what to do."""
    name = errno.errorcode.get(e.errno or 0, str(e.errno))
    where = f"{e.filename}: " if e.filename else ""
    why = f"on node {node_id}, {where}{e.strerror or e} ({name})"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        why += (f": the tier's file system is full; lower `outlast start --checkpoint-memory` below what is free "
                f"in {root}, or free space there")
    return why


def check_files(where: Path, files: Iterable[FileEntry], known: Mapping[str, str] | None = None) -> str | None:
    """Why the files under `where` differ from `files` (sizes, then checksums); None when they match.

    `known`: hex digests of files by path that need not be read again here: computed over their bytes as they
    were written (`InOrderDigests`), or, for a rank's file linked in, the checksum the rank took of it."""
    known = known or {}
    for entry in files:
        try:
            size = safepath.size_under(where, entry.path)
        except FileNotFoundError:
            return f"file {entry.path} is missing"
        except OSError as e:
            return f"file {entry.path} cannot be read: {e.strerror}"
        if size != entry.size:
            return f"file {entry.path} has {size} bytes, the record says {entry.size}"
        algorithm, expected = entry.checksum
        try:
            digest = known.get(entry.path) or safepath.hash_under(where, entry.path, algorithm)[1]
        except OSError as e:
            return f"file {entry.path} cannot be read: {e.strerror}"
        if digest != expected:
            return f"file {entry.path} does not match its checksum ({algorithm})"
    return None


class TierStore:
    def __init__(self, root: Path, node_id: str, budget_bytes: int, clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.node_id = node_id
        self.home = safepath.child(root, node_id)  # --node-id: one name under the tier's root
        self.book = TierBook(budget_bytes)
        self._records: dict[CopyKey, TierRecord] = {}
        self._pending: dict[CopyKey, TierRecord] = {}  # begun, not yet finished
        self._clock = clock
        self._spare: list[tuple[Path, int]] = []  # spare files and their sizes (the module's "Spare pages")
        self._spare_seq = 0
        self._received: set[CopyKey] = set()  # begun with `reuse` by this agent: their pages may be kept
        self._kept_ctimes: dict[CopyKey, dict[str, int]] = {}  # of a received copy's files when it was kept
        self._reading: dict[CopyKey, int] = {}  # copies being read off the lock (an upload): their pages are not

    # -- start ----------------------------------------------------------------------------

    def open(self) -> list[str]:
        """Take the node's directory: reclaim its whole copies, drop partial ones, free those of dead agents."""
        private_dir(self.root)
        said = self._free_dead_siblings()
        private_dir(self.home)
        owner = _read_owner(self.home)
        if owner is not None and owner.host == host_id() and owner.process.pid != os.getpid() \
                and still_running(owner.process, owner.process.pid)[0]:
            raise ValueError(f"node {self.node_id}'s memory tier in {self.home} belongs to pid {owner.process.pid}, "
                             "which still runs: two agents of one node id cannot share it; stop that one, or give "
                             "this one another --node-id")
        said += self._reclaim()
        (self.home / "owner.json").write_bytes(msgspec.json.encode(_Owner(this_process(), host_id())))
        return said

    def _free_dead_siblings(self) -> list[str]:
        said = []
        for other in sorted(p for p in self.root.iterdir() if p.is_dir() and p.name != self.node_id):
            owner = _read_owner(other)
            if owner is None or owner.host != host_id():  # not an agent's tier, or one being set up
                continue
            alive, _why = still_running(owner.process, owner.process.pid)
            if not alive:
                shutil.rmtree(other, ignore_errors=True)
                said.append(f"freed the memory tier of node {other.name}, whose agent (pid {owner.process.pid}) "
                            "is gone")
        return said

    def _reclaim(self) -> list[str]:
        shutil.rmtree(self.home / "restores", ignore_errors=True)  # links for restores that are over
        shutil.rmtree(self.home / _SPARE, ignore_errors=True)  # an earlier agent's, counted in no budget now
        kept, dropped = 0, []
        for record_path in sorted(self.home.glob("*/*/rank-*.json")):
            try:
                record = msgspec.json.decode(record_path.read_bytes(), type=TierRecord)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
                dropped.append(f"{record_path.parent.name} ({e})")
                record_path.unlink(missing_ok=True)
                continue
            # Sizes only: checksums are checked by every restore that reads a copy.
            where = copy_dir(self.root, self.node_id, record.key)
            bad = next((f.path for f in record.files if not _has_size(where, f)), None)
            if bad is not None:
                dropped.append(f"{record.checkpoint_dir} rank {record.rank} (file {bad} is not whole)")
                self._remove(record.key)
                continue
            admission = self.book.plan(record.copy())
            if not admission.admit:  # the budget shrank since
                dropped.append(f"{record.checkpoint_dir} rank {record.rank} ({admission.reason})")
                self._remove(record.key)
                continue
            for gone in self.book.apply(record.copy(), admission):
                self._remove(gone.key)
                self._records.pop(gone.key, None)
            self._records[record.key] = record
            kept += 1
        for partial in self.home.glob(f"*/*/*{_PARTIAL}"):
            shutil.rmtree(partial, ignore_errors=True)
        for leftover in self.home.glob("*/*/rank-*"):
            if leftover.is_dir() and not leftover.with_name(leftover.name + ".json").exists():
                shutil.rmtree(leftover, ignore_errors=True)
        said = [f"reclaimed {kept} checkpoint copies in memory"] if kept else []
        if dropped:
            said.append(f"dropped {len(dropped)} copies in memory that were not whole: {'; '.join(dropped)}")
        return said

    # -- copies in ----------------------------------------------------------------------

    def begin(self, run: str, checkpoint_dir: str, rank: int, seq: int, files: list[FileEntry],
              primary: bool = True, reuse: bool = False) -> tuple[Admission, Path | None]:
        """Make room for a copy (evicting as `TierBook.plan` says) and give the directory to write it in.
        `reuse`: a copy copied in or received by this agent, whose files are opened with
        `safepath.open_under(keep=True)`: spare files are placed there for them to be written over, and its
        own pages may be kept as spare when it goes."""
        record = TierRecord(run=run, checkpoint_dir=checkpoint_dir, rank=rank, seq=seq, files=list(files),
                            stored_at=self._clock(), primary=primary)
        negative = next((f for f in files if f.size < 0), None)
        if negative is not None:  # it would pass for room the other files take
            return Admission(False, (), f"{checkpoint_dir} rank {rank}: file {negative.path!r} declares "
                                        f"{negative.size} bytes; refused"), None
        admission, evicted = self.book.begin(record.copy())
        for gone in evicted:
            self._remove(gone.key)
            self._records.pop(gone.key, None)
        if not admission.admit or record.key in self._records:
            return admission, None
        self._pending[record.key] = record
        partial = self._partial(record.key)
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            if reuse:
                self._received.add(record.key)
                self._place_spare(partial, files)
        except OSError:
            self.abort(record.key)
            raise
        finally:
            self._trim_spare()
        return admission, partial

    def finish(self, key: CopyKey, known: Mapping[str, str] | None = None) -> str | None:
        """Check the written files against their record (`known`: as `check_files`) and keep them; why not, when
        they differ."""
        record = self._pending.pop(key, None)
        if record is None:
            return f"{key.checkpoint_dir} rank {key.rank} was not being written"
        partial = self._partial(key)
        try:
            why = check_files(partial, record.files, known)
        except OSError as e:
            why = os_failure(self.node_id, self.root, e)
        except ValueError as e:  # an entry without a checksum
            why = str(e)
        if why is not None:
            self.book.abort(key)
            self._let_go(key, partial)
            self._trim_spare()
            return f"{key.checkpoint_dir} rank {key.rank} was not kept in memory: {why}"
        admission, evicted = self.book.finish(record.copy())
        if not admission.admit:
            self._let_go(key, partial)
            self._trim_spare()
            return admission.reason
        for gone in evicted:
            self._remove(gone.key)
            self._records.pop(gone.key, None)
        self._trim_spare()
        final = copy_dir(self.root, self.node_id, key)
        try:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            self._write_record(record)
        except OSError as e:  # a full file system, at the record: nothing of the copy stays, in files or budget
            self.book.drop(key)
            self._remove(key)
            shutil.rmtree(partial, ignore_errors=True)
            self._trim_spare()
            return f"{key.checkpoint_dir} rank {key.rank} was not kept in memory: " \
                   f"{os_failure(self.node_id, self.root, e)}"
        self._records[key] = record
        if key in self._received:
            self._kept_ctimes[key] = _ctimes(final)
        return None

    def abort(self, key: CopyKey) -> None:
        """A copy being written that will not be: what it wrote goes, and its bytes in flight."""
        if self._pending.pop(key, None) is not None:
            self.book.abort(key)
            self._let_go(key, self._partial(key))
            self._trim_spare()

    def writing(self, key: CopyKey) -> bool:
        return key in self._pending

    def put_dir(self, run: str, checkpoint_dir: str, rank: int, seq: int, files: list[FileEntry], src: Path,
                primary: bool = True) -> str | None:
        """Copy a rank's files from a local directory; why not, when they are not kept."""
        admission, partial = self.begin(run, checkpoint_dir, rank, seq, files, primary)
        if partial is None:
            return None if admission.admit else admission.reason
        try:
            for entry in files:
                safepath.copy_under(src, entry.path, partial)
        except OSError as e:
            self.abort(CopyKey(run, checkpoint_dir, rank))
            return f"{checkpoint_dir} rank {rank} was not kept in memory: {os_failure(self.node_id, self.root, e)}"
        return self.finish(CopyKey(run, checkpoint_dir, rank))

    # -- reading, committing, freeing ----------------------------------------------------

    def record(self, key: CopyKey) -> TierRecord | None:
        return self._records.get(key)

    def records(self) -> list[TierRecord]:
        return sorted(self._records.values(), key=lambda r: (r.run, r.seq, r.rank))

    def path(self, key: CopyKey) -> Path | None:
        return copy_dir(self.root, self.node_id, key) if key in self._records else None

    def verify(self, key: CopyKey) -> str | None:
        """Check a held copy against its record; a copy that differs is dropped. Why, or None when whole."""
        record = self._records.get(key)
        if record is None:
            return f"{key.checkpoint_dir} rank {key.rank} is not held on {self.node_id}"
        why = check_files(copy_dir(self.root, self.node_id, key), record.files)
        if why is not None:
            self.drop(key)
            return f"the copy of {key.checkpoint_dir} rank {key.rank} in memory on {self.node_id}: {why}"
        return None

    def mark_committed(self, run: str, checkpoint_dir: str) -> None:
        """The budget protects the copies of `checkpoint_dir` from now on; their records say so for the next agent.
        A record that cannot be written (OSError, raised once every copy is marked) loses only that: the next
        agent reclaims its copy as not committed."""
        self.book.mark_committed(run, checkpoint_dir)
        failed: OSError | None = None
        for key, record in list(self._records.items()):
            if key.run == run and key.checkpoint_dir == checkpoint_dir and not record.committed:
                self._records[key] = msgspec.structs.replace(record, committed=True)
                try:
                    self._write_record(self._records[key])
                except OSError as e:
                    failed = failed or e
        if failed is not None:
            raise failed

    def drop(self, key: CopyKey) -> None:
        self.book.drop(key)
        self._records.pop(key, None)
        self._remove(key)
        self._trim_spare()

    def spare_bytes(self) -> int:
        """Bytes of spare pages kept for the next copy received (within the budget with `book.used()`)."""
        return sum(size for _, size in self._spare)

    def reading(self, key: CopyKey, n: int) -> None:
        """`n` more (or, negative, fewer) readers of a held copy off the lock: while one reads, the copy's pages
        are not kept as spare when it goes, but removed (a reader keeps them until it is done)."""
        left = self._reading.get(key, 0) + n
        if left > 0:
            self._reading[key] = left
        else:
            self._reading.pop(key, None)

    def free_run(self, run: str) -> int:
        keys = [k for k in self._records if k.run == run]
        for key in keys:
            self.drop(key)
        for key in [k for k in self._pending if k.run == run]:
            self.abort(key)
        # A run that ends gives its memory back: spare pages too, until a copy comes again.
        self._trim_spare(keep=0)
        shutil.rmtree(self.home / run_dir_name(run), ignore_errors=True)
        # The links its restores made: with the copies gone, they alone would keep the bytes.
        self._unlink_restores(run, None)
        return len(keys)

    def close(self, free: bool) -> None:
        """At the agent's end: free everything (an embedded node, whose id dies with it) or keep it to reclaim."""
        if free:
            shutil.rmtree(self.home, ignore_errors=True)

    # -- plumbing ---------------------------------------------------------------------------

    def _partial(self, key: CopyKey) -> Path:
        final = copy_dir(self.root, self.node_id, key)
        return final.with_name(final.name + _PARTIAL)

    def _write_record(self, record: TierRecord) -> None:
        final = copy_dir(self.root, self.node_id, record.key)
        path = final.with_name(final.name + ".json")
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_bytes(msgspec.json.encode(record))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _remove(self, key: CopyKey) -> None:
        final = copy_dir(self.root, self.node_id, key)
        final.with_name(final.name + ".json").unlink(missing_ok=True)
        self._let_go(key, final, kept=True)
        # A restore's links to the copy would keep its bytes outside the budget. A restore reads its run's newest
        # committed checkpoint, not evicted until a newer one is committed, by when the restore has been read.
        self._unlink_restores(key.run, key.checkpoint_dir)

    def _let_go(self, key: CopyKey, where: Path, kept: bool = False) -> None:
        """The files of `key` under `where` go: kept as spare where nobody else can see their pages, else
        removed. `kept`: a held copy, whose files must still be as `finish` left them (no link made or removed
        since: a restore's); a partial one has been seen by nobody. The caller trims what is spare to the
        budget (`_trim_spare`) once its book is settled."""
        seen = self._kept_ctimes.pop(key, {})
        if key in self._received and not self._reading.get(key) and where.is_dir():
            spare = self.home / _SPARE
            for path in sorted(where.rglob("*")):
                try:
                    st = path.lstat()
                    if not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid()
                            and st.st_size >= _SPARE_MIN):
                        continue
                    if kept and seen.get(path.relative_to(where).as_posix()) != st.st_ctime_ns:
                        continue
                    spare.mkdir(mode=0o700, exist_ok=True)
                    self._spare_seq += 1
                    target = spare / str(self._spare_seq)
                    os.rename(path, target)
                    # A link made between the look above and the move (a restore's) shows now; none can be made
                    # after it, the file's name being gone.
                    if target.lstat().st_nlink != 1:
                        target.unlink()
                        continue
                    self._spare.append((target, st.st_size))
                except OSError:
                    continue  # removed with the rest below
        self._received.discard(key)
        shutil.rmtree(where, ignore_errors=True)

    def _place_spare(self, partial: Path, files: list[FileEntry]) -> None:
        """Spare files moved to where `files` go under `partial` (the largest spare for the largest file), cut to
        their sizes: the copy is written over their pages."""
        self._spare.sort(key=lambda s: s[1])
        for entry in sorted(files, key=lambda f: f.size, reverse=True):
            if not self._spare or entry.size <= 0:
                break
            path, size = self._spare.pop()
            try:
                parent, name = safepath.open_parent(partial, entry.path)
            except OSError:
                path.unlink(missing_ok=True)  # its pages go; the path is refused where the copy's file is opened
                continue
            try:
                os.rename(path, name, dst_dir_fd=parent)
                if size > entry.size:
                    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
                    try:
                        os.ftruncate(fd, entry.size)
                    finally:
                        os.close(fd)
            except OSError:
                path.unlink(missing_ok=True)  # its pages go; the file is made anew where it was to be
            finally:
                os.close(parent)

    def _trim_spare(self, keep: int | None = None) -> None:
        """Spare files removed, smallest first, until what is spare is at most `keep` bytes (default: what the
        budget leaves beside the copies held and being written)."""
        room = self.book.budget_bytes - self.book.used() if keep is None else keep
        self._spare.sort(key=lambda s: s[1], reverse=True)
        while self._spare and self.spare_bytes() > max(room, 0):
            path, _ = self._spare.pop()
            path.unlink(missing_ok=True)
        if not self._spare:
            try:
                (self.home / _SPARE).rmdir()
            except OSError:  # absent, or not empty: a file of ours it does not list is removed at the next start
                pass

    def _unlink_restores(self, run: str, checkpoint_dir: str | None) -> None:
        """The restore links of `run` (of one checkpoint, or all), under the lock its restores take."""
        restores = self.home / "restores" / run_dir_name(run)
        if not restores.is_dir():
            return
        gone = restores / checkpoint_dir if checkpoint_dir is not None else restores
        try:
            with open(restores / ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                shutil.rmtree(gone, ignore_errors=True)
        except OSError:  # no lock to be had (a full file system): the links go all the same
            shutil.rmtree(gone, ignore_errors=True)


def _read_owner(home: Path) -> _Owner | None:
    try:
        return msgspec.json.decode((home / "owner.json").read_bytes(), type=_Owner)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _has_size(where: Path, entry: FileEntry) -> bool:
    try:
        return safepath.size_under(where, entry.path) == entry.size
    except OSError:
        return False


def _ctimes(where: Path) -> dict[str, int]:
    """The ctime of each regular file under `where`, by its path relative to it."""
    out = {}
    for path in where.rglob("*"):
        try:
            st = path.lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out[path.relative_to(where).as_posix()] = st.st_ctime_ns
    return out
