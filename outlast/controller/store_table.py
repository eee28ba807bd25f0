"""A driver's node table from its own watch on the cluster store, for clusters kept in etcd.

The driver hears of the table and of drains from etcd directly, so neither the death of the agent
it attached to nor a moment with no head elected hides a drain from it. A drain seen here reaches
the run as the drained node's own notice would (the run takes the earlier of the two). While etcd
has no majority the driver places nothing new: its table is empty until the store answers again,
and until a read with a majority behind it has replaced any view read from one member alone.
"""

from __future__ import annotations

import logging
import time

from outlast.cluster.etcd_store import EtcdConfig, EtcdStore, namespace_of
from outlast.cluster.sealed import Sealer
from outlast.cluster.store_session import StoreSession
from outlast.controller import group as g
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey

log = logging.getLogger("outlast.controller")


class StoreTable:
    def __init__(self, session: StoreSession) -> None:
        """Over a session not yet started (a test's, over a fake store, times its answers); `connect` makes one."""
        self.session = session.start()
        self._seen: tuple[int, bool] | None = None
        self._told: dict[str, m.NodeDraining] = {}
        self._wanted = False

    @classmethod
    def connect(cls, config: EtcdConfig, key: ClusterKey) -> "StoreTable":
        store = EtcdStore(config, namespace_of(key.public), sealer=Sealer(key.secret))  # checks every record
        return cls(StoreSession(store, lambda _view: store.probe(), interval_s=min(1.0, config.lease_ttl_s / 3)))

    @classmethod
    def from_env(cls, key: ClusterKey | None) -> "StoreTable | None":
        """The store named by $OUTLAST_ETCD (LocalCluster and `outlast slurm` set it), or None: ask the head."""
        config = EtcdConfig.from_env()
        return cls.connect(config, key) if config is not None and key is not None else None

    def want(self) -> None:
        """The core asked for the table: it gets one on the next poll even if nothing changed."""
        self._wanted = True

    def nodes(self, timeout_s: float) -> list[m.NodeInfo] | None:
        if not self.session.read_once.wait(timeout_s):
            return None
        with self.session.lock:
            nodes, _, why = self._table()
        if why is not None:
            log.warning("%s; nothing new is placed until it is back", why)
        return nodes

    def poll(self) -> list[g.InEvent]:
        with self.session.lock:
            seen = (self.session.version, self.session.no_majority(time.time()) is None)
            if self._seen == seen and not self._wanted:
                return []
            self._seen, self._wanted = seen, False
            nodes, drains, why = self._table()
        if why is not None:
            log.warning("%s; nothing new is placed until it is back", why)
        out: list[g.InEvent] = [g.NodeTable(nodes)]
        for node_id, notice in drains.items():
            if self._told.get(node_id) != notice:
                self._told[node_id] = notice
                out.append(g.FromAgent(node_id, notice))
        return out

    def _table(self) -> tuple[list[m.NodeInfo], dict[str, m.NodeDraining], str | None]:
        """The table and the live nodes' drains, both empty while the view may not be placed on (and why).
        Called holding the session's lock, so the verdict is about the very view the table is read from."""
        why = self.session.no_majority(time.time())
        if why is not None:
            return [], {}, why
        nodes = self.session.view.table()
        drains = {n: d for n, d in self.session.view.drains.items()
                  if any(x.node_id == n and x.state != "dead" for x in nodes)}
        return nodes, drains, None

    def close(self) -> None:
        self.session.stop()
