"""Carrying out the core's memory-tier requests off the controller's loop.

Each `TierAsk` goes to a node's tier server on a thread of a small pool, so that a replica that
takes a minute to reach its peer holds up neither the loop nor another node's copy; its answer
waits in `take()`, and a byte on `wake_fd` wakes the loop for it, as storage's answers do.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import zmq

from outlast.controller import effects as fx
from outlast.controller.wakeup import Wakeup
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.protocol.transport import TIER_REPLIES, connect_dealer, encode

log = logging.getLogger("outlast.controller")


class TierExecutor:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], key: ClusterKey | None, threads: int = 4) -> None:
        self._ctx, self._key = ctx, key
        # Daemon threads: a request still waiting on a dead node when the run ends must not keep the
        # driver's process from exiting (a pool's threads are joined at exit).
        self._todo: queue.Queue[fx.TierAsk | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._run, name=f"outlast-tier-ask-{i}", daemon=True)
                         for i in range(threads)]
        self._answers: deque[fx.TierAnswered] = deque()
        self._lock = threading.Lock()
        self._wakeup = Wakeup()
        for t in self._threads:
            t.start()

    @property
    def wake_fd(self) -> int:
        return self._wakeup.fileno()

    def submit(self, effect: fx.TierAsk) -> None:
        self._todo.put(effect)

    def _run(self) -> None:
        while (effect := self._todo.get()) is not None:
            self._ask(effect)

    def take(self) -> list[fx.TierAnswered]:
        self._wakeup.clear()
        with self._lock:
            out = list(self._answers)
            self._answers.clear()
        return out

    def close(self) -> None:
        """Requests not begun are dropped, those running let go: their copies are the nodes' to keep or evict."""
        while True:
            try:
                self._todo.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._todo.put(None)
        self._wakeup.close()  # a request still running rings a closed pipe: nothing

    def _request(self, effect: fx.TierAsk) -> m.TierReply:
        sock = connect_dealer(self._ctx, effect.address, key=self._key)
        try:
            sock.send(encode(effect.msg))
            if not sock.poll(int(effect.timeout_s * 1000)):
                raise TimeoutError(f"no answer for {effect.timeout_s:.0f} s")
            return TIER_REPLIES.decode(sock.recv())
        finally:
            sock.close(linger=0)

    def _ask(self, effect: fx.TierAsk) -> None:
        try:
            answer = fx.TierAnswered(effect.id, reply=self._request(effect))
        except (zmq.ZMQError, OSError) as e:
            answer = fx.TierAnswered(effect.id, error=f"the memory tier of {effect.node_id} did not answer: {e}")
        except Exception as e:  # noqa: BLE001 - the loop must hear of it, or a commit waits for ever
            log.exception("a memory tier request to %s raised", effect.node_id)
            answer = fx.TierAnswered(effect.id, error=f"{type(e).__name__}: {e}")
        with self._lock:
            self._answers.append(answer)
        self._wakeup.ring()
