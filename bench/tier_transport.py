"""A checkpoint copy between two nodes' memory, on loopback: the tier's replica beside its floors and Ray's.

    .venv/bin/python -m bench.tier_transport [--mb 1024] [--repeats 3] [--out bench/results/tier-transport.json]

Each repeat, interleaved, with the receiving side in a process of its own (as a peer's agent is):
- `tier_replica`: a `TierHold` of one file of --mb MB (random bytes) on a tier server with the
  cluster key, pushed to a peer's tier server: its `replica_seconds`, the transfer alone (offer,
  sealed chunks on the data socket, the peer's check and keep). Both servers last the whole run,
  each with a budget of 1.5 copies, so each repeat's copy evicts the one before and is written into
  its pages, as a run's checkpoints are (the first repeat has none to reuse: `seconds[0]`);
- `tier_pull`: that copy pulled from the peer by a third tier server that holds nothing of it (a
  `TierPull`, as a rank's new node after a failure restores from a peer's memory): its `seconds`
  (fetch over CURVE, chunks sealed by the peer on the data socket, opened into this node's pages
  and checked as they come), the third node's budget 1.5 copies as well;
- `zmq_curve`: the same bytes in the tier's 8 MiB chunks, at most 4 unanswered, on one ZeroMQ
  socket with CURVE (how the tier sent them before its data socket);
- `zmq_plain`: the same on a socket without encryption: the transport's floor;
- `ray`: Ray 2.60's object transfer between two nodes of a `ray.cluster_utils.Cluster` (a task on
  the second node makes a numpy array of --mb MB, the driver on the first `ray.get`s it), when
  bench/.ray-venv exists (bench/setup_ray_venv.sh). Ray's transfer is not encrypted.

MB/s are the copy's bytes over its seconds; ratios are outlast's rate over the other's. One JSON
document on stdout (and --out), progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.venvs import RAY_PY, ROOT

PEER = r"""
import sys, time, zmq
from pathlib import Path
from outlast.agent.tier_server import TierServer
from outlast.protocol.auth import ClusterKey, start_authenticator
from outlast.storage.tier_store import TierStore
key = ClusterKey(sys.argv[1].encode())
ctx = zmq.Context()
auth = start_authenticator(ctx, key)
server = TierServer(ctx, key, TierStore(Path(sys.argv[2]), "peer", int(sys.argv[3]))).start()
server.store.open()
print(server.address, flush=True)
sys.stdin.read()
server.stop()
"""

SINK = r"""
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
if sys.argv[1] == "curve":
    sock.curve_server = True
    sock.curve_secretkey = sys.argv[2].encode()
    sock.curve_publickey = zmq.curve_public(sys.argv[2].encode())
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    frames = sock.recv_multipart(copy=False)
    if frames[1].bytes == b"end":
        sock.send_multipart([frames[0], b"bye"])
        break
    sock.send_multipart([frames[0], b"ack"])
"""

RAY = r"""
import json, sys, time
import numpy as np
import ray
from ray.cluster_utils import Cluster
mb, repeats = int(sys.argv[1]), int(sys.argv[2])
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"here": 1},
                                                        "object_store_memory": (mb + 512) << 20})
cluster.add_node(num_cpus=1, resources={"there": 1}, object_store_memory=(mb + 512) << 20)
ray.init(address=cluster.address)
cluster.wait_for_nodes()

@ray.remote(resources={"there": 1}, num_cpus=0)
def make(n):
    return np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)

times = []
for _ in range(repeats):
    ref = make.remote(mb << 20)
    ray.wait([ref], fetch_local=False)  # made and sealed on the other node: only the transfer is timed
    t = time.perf_counter()
    arr = ray.get(ref)
    times.append(time.perf_counter() - t)
    assert arr.nbytes == mb << 20
    del arr, ref
print(json.dumps(times))
ray.shutdown()
cluster.shutdown()
"""


def log(msg: str) -> None:
    print(f"[tier-transport {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class TierPair:
    """Two tier servers, this process's and a peer's in a process of its own, kept across the repeats as a
    node's are across a run's checkpoints: each budget holds one copy and a half, so that each repeat's
    copy evicts the one before it and is written into its pages (`TierStore`'s spare pages), as Ray's
    object store reuses its own between repeats. The first repeat finds none."""

    def __init__(self, nbytes: int) -> None:
        import zmq

        from outlast.agent.tier_server import TierServer
        from outlast.protocol.auth import ClusterKey, start_authenticator
        from outlast.storage.tier_store import TierStore

        budget = nbytes * 3 // 2
        self.key = ClusterKey.generate()
        self.peer_root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="tier-bench-peer-"))
        self.peer = subprocess.Popen([sys.executable, "-c", PEER, self.key.secret.decode(), str(self.peer_root),
                                      str(budget)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, self.key)
        self.here_root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="tier-bench-here-"))
        self.here = TierServer(self.ctx, self.key, TierStore(self.here_root, "here", budget)).start()
        self.here.store.open()
        # A node that holds nothing of the copy, as a rank's new node after a failure, pulls it from the peer.
        self.third_root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="tier-bench-third-"))
        self.third = TierServer(self.ctx, self.key, TierStore(self.third_root, "third", budget)).start()
        self.third.store.open()
        self.address = self.peer.stdout.readline().strip()
        self.seq = 0

    def replica(self, src: Path, files) -> float:
        from outlast.agent.tier_client import ask
        from outlast.protocol import messages as m

        self.seq += 1
        stored = ask(self.ctx, self.key, self.here.address,
                     m.TierHold(run="bench", checkpoint_dir=f"c{self.seq}", rank=0, seq=self.seq, files=files,
                                source_dir=str(src), peer_address=self.address))
        if not (stored.ok and stored.replica_node == "peer"):
            raise RuntimeError(f"the replica failed: {stored}")
        return stored.replica_seconds

    def pull(self) -> float:
        """The last replica's copy pulled from the peer by the third node (a restore from a peer's memory)."""
        from outlast.agent.tier_client import ask
        from outlast.protocol import messages as m

        from outlast.storage.memtier import CopyKey

        # What a node pulls is held as committed, so the budget keeps it until a newer checkpoint of the run is
        # committed there, which this node never hears of: the copy it pulled before goes as it would then.
        with self.third._lock:
            self.third.store.drop(CopyKey("bench", f"c{self.seq - 1}", 0))
        stored = ask(self.ctx, self.key, self.third.address,
                     m.TierPull(run="bench", checkpoint_dir=f"c{self.seq}", rank=0, from_address=self.address))
        if not stored.ok:
            raise RuntimeError(f"the pull failed: {stored}")
        return stored.seconds

    def close(self) -> None:
        self.third.stop()
        self.here.stop()
        self.auth.stop()
        self.ctx.term()
        self.peer.stdin.close()
        self.peer.wait(timeout=60)
        subprocess.run(["rm", "-rf", str(self.peer_root), str(self.here_root), str(self.third_root)], check=False)


def zmq_chunks(path: Path, curve: bool) -> float:
    import zmq

    from outlast.agent.tier_client import CHUNK, WINDOW, file_view

    public, secret = zmq.curve_keypair()
    sink = subprocess.Popen([sys.executable, "-c", SINK, "curve" if curve else "plain", secret.decode()],
                            stdout=subprocess.PIPE, text=True)
    port = int(sink.stdout.readline())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if curve:
        sock.curve_serverkey = public
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(f"tcp://127.0.0.1:{port}")
    view = file_view(path.parent, path.name)
    try:
        started = time.perf_counter()
        in_flight = 0
        for offset in range(0, len(view), CHUNK):
            while in_flight >= WINDOW:
                sock.recv()
                in_flight -= 1
            sock.send(view[offset:offset + CHUNK], copy=False)
            in_flight += 1
        for _ in range(in_flight):
            sock.recv()
        seconds = time.perf_counter() - started
        sock.send(b"end")
        sock.recv()
        return seconds
    finally:
        sock.close(linger=0)
        ctx.term()
        sink.wait(timeout=30)


def summary(mb: int, seconds: list[float]) -> dict:
    rates = [mb * 1.048576 / s for s in seconds]  # MB (10^6 bytes) per second
    return {"seconds": seconds, "median_s": statistics.median(seconds), "mb_per_s_median": statistics.median(rates),
            "mb_per_s_range": [min(rates), max(rates)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()

    from outlast.protocol import messages as m
    from outlast.storage.checksum import hash_file

    workdir = Path(tempfile.mkdtemp(prefix="tier-bench-"))
    src = workdir / "ckpt"
    src.mkdir()
    with open(src / "model.pt", "wb") as f:
        for _ in range(args.mb):
            f.write(os.urandom(1 << 20))
    files = [m.FileEntry(path="model.pt", size=args.mb << 20, xxh3_128=hash_file(src / "model.pt")[1])]
    pair = TierPair(args.mb << 20)
    cases = {"tier_replica": lambda: pair.replica(src, files),
             "tier_pull": pair.pull,
             "zmq_curve": lambda: zmq_chunks(src / "model.pt", curve=True),
             "zmq_plain": lambda: zmq_chunks(src / "model.pt", curve=False)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    loads = []
    for r in range(args.repeats):
        for name, case in cases.items():
            loads.append(os.getloadavg()[0])
            times[name].append(case())
            log(f"repeat {r + 1}: {name} {times[name][-1]:.2f} s")
    pair.close()
    doc = {"mb": args.mb, "repeats": args.repeats, "cpus": os.cpu_count(),
           "load_avg_1m": [min(loads), max(loads)]}
    doc.update({name: summary(args.mb, t) for name, t in times.items()})
    if os.path.exists(RAY_PY):
        log("Ray 2.60: an object between two nodes")
        done = subprocess.run([RAY_PY, "-c", RAY, str(args.mb), str(args.repeats)], capture_output=True, text=True,
                              timeout=900)
        if done.returncode == 0:
            doc["ray"] = summary(args.mb, json.loads(done.stdout.strip().splitlines()[-1]))
        else:
            doc["ray"] = {"error": done.stderr[-2000:]}
    doc["ratios"] = {f"{t}_over_{k}": doc[t]["mb_per_s_median"] / doc[k]["mb_per_s_median"]
                     for t in ("tier_replica", "tier_pull") for k in ("zmq_curve", "zmq_plain", "ray")
                     if "mb_per_s_median" in doc.get(k, {})}
    subprocess.run(["rm", "-rf", str(workdir)], check=False)
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
