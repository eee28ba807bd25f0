"""A live view of the cluster store: a watch keeps it current, a beat keeps this process's place in it.

Two daemon threads, so that a store without a majority never blocks the caller's loop: the watch
thread reads the cluster's keys and follows their changes (reading them again after any break,
from whichever member answers), and the beat thread calls `beat(view)` every `interval_s` (renew
a lease, write what changed, check a majority) and records whether the store answered.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from outlast.cluster.etcd_store import EtcdStore, StoreUnavailable
from outlast.cluster.store_view import ClusterView, StoreEvent
from outlast.protocol.messages import StoreHealth

log = logging.getLogger("outlast.store")

Beat = Callable[[ClusterView], None]


class StoreSession:
    def __init__(self, store: EtcdStore, beat: Beat, interval_s: float) -> None:
        self.store, self._beat, self.interval_s = store, beat, interval_s
        self.lock = threading.Lock()  # guards `view` and `version`
        self.view = ClusterView(store.sealer)
        self._said: set[tuple[str, str]] = set()  # refused records already in the log
        self.version = 0  # bumped on every change of the view
        self.read_once = threading.Event()
        self.unavailable_since: float | None = None
        self.detail = ""
        # The view came from one member alone: read it again once a majority answers. Guarded by `lock`, set
        # with the view it describes. A fresh session's view is not yet from anywhere: `read_once` is unset.
        self._partial = False
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._watch_loop, name="outlast-store-watch", daemon=True),
                         threading.Thread(target=self._beat_loop, name="outlast-store-beat", daemon=True)]

    def start(self) -> "StoreSession":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.store.stop_watch()
        for t in self._threads:
            if t.ident is not None:  # a node that never joined never started them
                # Daemons: one in a call to a store that does not answer ends with the process. A stop
                # must stay quick (Slurm kills a step that takes long, before it cleans up).
                t.join(timeout=0.5)

    def no_majority(self, now_unix: float) -> str | None:
        """Why what the view says may not be acted on (nothing new placed on it), or None when it may: it was
        read with a majority behind it and no beat has found that majority gone since. Call it holding `lock`,
        so the answer is about the view read under the same hold.

        A view read from one member alone is refused even before the first beat has answered: the read with a
        majority and the beat's probe fail at the same moment (both wait out the same call timeout on the
        lone member), and the fallback read that follows is quick, so on a loaded machine it can land before
        the probe's failure is recorded. A table from that member would place a run while etcd has no majority."""
        if self.unavailable_since is not None:
            return (f"the cluster store has been unavailable for {now_unix - self.unavailable_since:.0f} s "
                    f"({self.detail})")
        if self._partial:
            return "the cluster store's view was read from one etcd member alone: no majority is known behind it"
        return None

    def health(self) -> StoreHealth:
        with self.lock:
            head = self.view.head or ""
        return StoreHealth(kind="etcd", available=self.unavailable_since is None,
                           unavailable_since_unix=self.unavailable_since, detail=self.detail, head=head)

    # ---- threads --------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                try:
                    items, revision = self.store.read_all()
                    partial = False
                except StoreUnavailable:
                    # Without a majority, what one member has (a restarting one may not have replayed
                    # everything yet): better than nothing for drains, and replaced once the store is back.
                    items, revision = self.store.read_all(serializable=True)
                    partial = True
                with self.lock:
                    self.view.reset(items)
                    self._partial = partial
                    self.version += 1
                    self._say_refused()
                self.read_once.set()
                self.store.watch(revision + 1, self._on_events, self._stopping)
            except Exception as e:  # noqa: BLE001 - a broken stream or a lost member: read again and rewatch
                log.debug("the store's watch broke (%s); reading again", e)
            self._stopping.wait(0.2)

    def _on_events(self, events: list[StoreEvent]) -> None:
        with self.lock:
            changed = [self.view.apply(e) for e in events]
            if any(changed):
                self.version += 1
            self._say_refused()

    def _say_refused(self) -> None:
        for key, why in self.view.refused:
            if (key, why) not in self._said:
                self._said.add((key, why))
                log.warning("refused the cluster store's record %s: %s; it is left out of the node table", key, why)
        self.view.refused.clear()

    def _beat_loop(self) -> None:
        while True:
            try:
                with self.lock:
                    view = self.view.copy()
                self._beat(view)
                if self.unavailable_since is not None:
                    log.warning("the cluster store is available again after %.1f s",
                                time.time() - self.unavailable_since)
                self.unavailable_since, self.detail = None, ""
                if self._partial:
                    self.store.stop_watch()  # the watch loop reads everything again, with the majority
            except StoreUnavailable as e:
                if self.unavailable_since is None:
                    self.unavailable_since = time.time()
                    log.warning("the cluster store is unavailable: %s; runs go on, nothing new is placed", e)
                self.detail = str(e)
            except Exception:  # noqa: BLE001 - a bug in a beat must not end the node's place in the cluster
                log.exception("the cluster store's beat failed")
            if self._stopping.wait(self.interval_s):
                return


__all__ = ["StoreSession"]
