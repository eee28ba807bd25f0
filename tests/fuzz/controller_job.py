"""The controller's door, knocked on from inside a run: rank 0's train function holds what every worker holds
(its run's credential, the driver's address) and sends the driver generated messages from a socket of its own.

The run is the test: it must end as the train function says (its last report), with the driver up all along;
`fuzz_the_driver` checks after every batch that the driver still answers a valid `CheckpointsQuery`.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path

import msgspec
import zmq

import outlast.train as train
from outlast.protocol import messages as m
from outlast.protocol.run_credential import worker_key
from outlast.protocol.transport import HEADER, TO_WORKER, BadMessage, connect_dealer, encode
from outlast.testing import LocalCluster
from outlast.train import Result, RunConfig, ScalingConfig, Trainer
from tests.fuzz.hostile import Hostile, Targets, classes_of

ANSWER_S = 60.0
GHOST = 7  # a rank the one-worker run does not have


def fuzz_the_driver(config: dict) -> None:
    from outlast.train._session import get_session

    session = get_session("fuzz")
    context = train.get_context()
    attempt = context.get_attempt() if hasattr(context, "get_attempt") else 0
    h = Hostile(random.Random(config["seed"]), Targets(config["canary"]))
    ctx = zmq.Context()
    # As a rank of this attempt that does not exist: the driver's answers to it come to this socket.
    sock = connect_dealer(ctx, session._controller_address, f"{attempt}:{GHOST}".encode(), key=worker_key())
    answers: Counter[str] = Counter()
    classes = classes_of(m.WorkerMessage)
    cases = 0
    started = time.monotonic()
    until = config.get("until", float("inf"))  # a wall-clock safety stop (bench/fuzz_doors.py --minutes)

    def write_out() -> None:
        Path(config["out"]).write_text(json.dumps({"cases": cases, "answers": dict(answers.most_common()),
                                                   "seconds": round(time.monotonic() - started, 1)}))

    try:
        # What the fuzzer found first, sent every time: a count no rank reaches (its answer, index + horizon,
        # did not encode and ended the driver), and a WorkerDone of a rank the attempt does not have.
        for found in (m.PreemptionQuery(attempt=attempt, rank=0, index=2**64 - 1),
                      m.WorkerDone(attempt=attempt, rank=GHOST, reports=0)):
            sock.send(encode(found))
        while cases < config["count"] and time.time() < until:
            for _ in range(min(config["batch"], config["count"] - cases)):
                msg = h.message(h.rng.choice(classes))
                if h.rng.random() < 0.3:  # as this attempt's own rank would send it: its hostile fields reach the core
                    # Rank 0 is this worker: a WorkerDone of its own would end its part of the run, as it may.
                    own = msg["type"] != "WorkerDone"
                    msg.update(attempt=attempt, rank=h.rng.choice([0, 0, GHOST, 1, -1, 2**31] if own else [GHOST, 1]))
                frames = [HEADER + msgspec.msgpack.encode(msg)] if h.rng.random() < 0.8 else h.multipart(classes)
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                cases += 1
                _take(sock, answers, 0)
            # A valid request through the public interface: answered by the driver once it has read every
            # message before it (a driver that died ends this worker instead).
            train.get_all_reported_checkpoints(timeout_s=ANSWER_S)
            answers["CheckpointsList (to rank 0)"] += 1
            _take(sock, answers, 0)
            write_out()  # how far it got, should the driver end before the run does
    finally:
        sock.close(linger=0)
        ctx.term()
        write_out()
    train.report({"cases": cases})


def _take(sock: zmq.Socket, answers: Counter, timeout_s: float) -> bool:
    """Count what the driver answered; True once a CheckpointsList (the answer to the check) came."""
    listed = False
    while sock.poll(int(timeout_s * 1000)):
        timeout_s = 0
        try:
            msg = TO_WORKER.decode(sock.recv())
        except BadMessage:
            answers["malformed answer"] += 1
            continue
        answers[type(msg).__name__] += 1
        listed = listed or isinstance(msg, m.CheckpointsList)
    return listed


def fuzz_a_run(storage_path: str, canary: Path, out: Path, seed: int, count: int, batch: int,
               until: float = float("inf"), workdir: Path | None = None) -> tuple[Result, dict]:
    """One run on a one-node cluster of its own whose rank 0 is `fuzz_the_driver`: (the run's result, what the
    fuzzer counted). The test and bench/fuzz_doors.py both fuzz the driver through this."""
    with LocalCluster(num_nodes=1, preload=[], workdir=workdir):
        result = Trainer(fuzz_the_driver,
                         train_loop_config={"seed": seed, "count": count, "batch": batch, "canary": str(canary),
                                            "out": str(out), "until": until},
                         scaling_config=ScalingConfig(num_workers=1),
                         run_config=RunConfig(name="fuzzed", storage_path=storage_path)).fit()
    seen = json.loads(out.read_text()) if out.exists() else {"cases": 0, "answers": {}}
    return result, seen
