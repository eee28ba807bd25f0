"""Random schedules over the memory tier's pure core and real copies on disk: nodes hold and replicate
checkpoints within their budgets, die and have copies corrupted; after every step a restore must take a
memory-committed checkpoint while one copy of each of its ranks' files lives, and must never read a copy
whose checksum does not match."""

import os
import random
import shutil

import pytest

from outlast.protocol import messages as m
from outlast.storage.checksum import hash_file
from outlast.storage.local import LocalStorage
from outlast.storage.memtier import Candidate, Level, PeerCandidate, choose_peer, choose_restore, memory_committed
from outlast.storage.records import Manifest
from outlast.storage.run_store import RunStore
from outlast.storage.tier_restore import assemble
from outlast.storage.tier_store import TierStore, check_files

KB = 1024


def _schedule(seed, tmp_path):
    rng = random.Random(seed)
    n_nodes, ranks = rng.randint(2, 5), rng.randint(1, 4)
    domains = [rng.choice(["a", "b", ""]) for _ in range(n_nodes)]
    nodes = [f"n{i}" for i in range(n_nodes)]
    root = tmp_path / f"tier-{seed}"
    stores = {n: TierStore(root, n, rng.choice([8, 16, 64]) * KB) for n in nodes}
    for s in stores.values():
        s.open()
    home = {r: rng.choice(nodes) for r in range(ranks)}
    domain = {n: d or f"node:{n}" for n, d in zip(nodes, domains)}
    alive = set(nodes)
    storage = LocalStorage(tmp_path / f"storage-{seed}")
    candidates: list[Candidate] = []
    holders: dict[tuple[str, int], set[str]] = {}
    src = tmp_path / f"src-{seed}"
    for seq in range(1, rng.randint(2, 6)):
        name = f"checkpoint_000_{seq:06d}"
        if any(home[r] not in alive for r in range(ranks)):
            break  # the run would restart first; the schedule stops at the first failure that matters
        files = {}
        for r in range(ranks):
            shutil.rmtree(src, ignore_errors=True)
            src.mkdir(parents=True)
            (src / f"shard{r}.bin").write_bytes(os.urandom(rng.randint(1, 6) * KB))
            entry = m.FileEntry(path=f"shard{r}.bin", size=(src / f"shard{r}.bin").stat().st_size,
                                xxh3_128=hash_file(src / f"shard{r}.bin")[1])
            files[r] = entry
            run = storage.uri("run")
            held = set()
            if stores[home[r]].put_dir(run, name, r, seq, [entry], src) is None:
                held.add(home[r])
            peer = choose_peer(home[r], [PeerCandidate(n, domains[i], n in alive) for i, n in enumerate(nodes)])
            if peer.node_id and stores[peer.node_id].put_dir(run, name, r, seq, [entry], src, primary=False) is None:
                held.add(peer.node_id)
            holders[(name, r)] = held
        ok, _ = memory_committed(range(ranks), home, holders and {r: holders[(name, r)] for r in range(ranks)},
                                 domain)
        durable = rng.random() < 0.3
        level = Level.DURABLE if durable else Level.MEMORY if ok else Level.NONE
        if level is Level.NONE:
            continue
        for s in stores.values():
            s.mark_committed(storage.uri("run"), name)
        RunStore(storage, "run").write_manifest(Manifest(checkpoint_dir=name, seq=seq, attempt=0, report_index=seq,
                                                         committed_at=float(seq), ranks=list(range(ranks)),
                                                         files=list(files.values())))
        candidates.append(Candidate(name, seq, seq * 10, level, frozenset(range(ranks))))
        # Events between checkpoints: a node dies, a copy rots.
        if rng.random() < 0.4 and len(alive) > 1:
            alive.discard(rng.choice(sorted(alive)))
        if rng.random() < 0.4:
            victim = rng.choice(nodes)
            for record in stores[victim].records():
                where = stores[victim].path(record.key)
                with open(where / record.files[0].path, "r+b") as f:
                    head = f.read(2)
                    f.seek(0)
                    f.write(bytes(b ^ 0xFF for b in head))  # changed whatever they were
                break
        yield storage, stores, alive, candidates, holders, ranks


def _live_holders(stores, alive, name, rank):
    """Nodes alive that hold a whole copy of `rank`'s files of `name` (read from their files)."""
    out = set()
    for n in alive:
        for record in stores[n].records():
            # Checked without dropping: the restores below must meet the corrupted copies too.
            if record.checkpoint_dir == name and record.rank == rank \
                    and check_files(stores[n].path(record.key), record.files) is None:
                out.add(n)
    return out


@pytest.mark.parametrize("seed", range(60))
def test_every_step_restores_a_living_memory_checkpoint_and_never_reads_a_bad_copy(seed, tmp_path):
    for storage, stores, alive, candidates, _holders, ranks in _schedule(seed, tmp_path):
        live = {(c.checkpoint_dir, r): _live_holders(stores, alive, c.checkpoint_dir, r)
                for c in candidates for r in range(ranks)}
        choice = choose_restore(candidates, live, alive)
        newest_alive = max((c for c in candidates if c.level is Level.DURABLE
                            or all(live[(c.checkpoint_dir, r)] for r in range(ranks))),
                           key=lambda c: c.seq, default=None)
        assert choice.checkpoint_dir == (newest_alive.checkpoint_dir if newest_alive else None), choice.reason
        if newest_alive is not None:
            assert choice.steps_lost == max(c.step for c in candidates) - newest_alive.step
        if choice.level is not Level.MEMORY:
            continue
        manifest = RunStore(storage, "run").read_manifest(choice.checkpoint_dir)
        for node in sorted(alive):
            path, _said = assemble(stores[node].root, node, storage.uri("run"), manifest)
            if path is None:
                continue
            for entry in manifest.files:  # what a restore hands the rank matches the manifest, byte for byte
                assert hash_file(path / entry.path)[1] == entry.xxh3_128
