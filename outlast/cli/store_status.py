"""What `outlast status` says of the cluster store (etcd), from an agent's `StoreHealth`."""

from __future__ import annotations

import time

from outlast.protocol.messages import StoreHealth


def render_store(h: StoreHealth, now_unix: float) -> str:
    head = f"the head role is held by {h.head}" if h.head else "no agent holds the head role yet"
    if h.available:
        return f"cluster store: etcd, available; {head}"
    since = h.unavailable_since_unix or now_unix
    stamp = time.strftime("%H:%M:%S", time.localtime(since))
    return (f"cluster store: etcd, UNAVAILABLE since {stamp} ({now_unix - since:.0f} s): runs keep training, "
            f"nothing new is placed until etcd has a majority again; {head}\n  etcd said: {h.detail}")
