"""Which local address a gloo group binds to, and advertises to its peers.

Left to itself, gloo binds to the address this machine's hostname resolves to, often 127.0.x.1
(/etc/hosts), which no rank on another node can reach: each gloo peer connects to the address
another advertised. A rank instead binds to the address its packets toward a host every rank
reaches (rank 0's node, the controller's store) leave from. On one machine that host is
127.0.0.1 and so is the address; on a node with its own network (another machine, a network
namespace) it is that node's address on the network the others share.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroupGloo

IFNAME_VAR = "GLOO_SOCKET_IFNAME"  # the user's choice of interface, which gloo reads itself and which wins


def local_address_toward(host: str | None) -> str | None:
    """The local IPv4 address that packets to `host` leave from, or None if there is no route or no host."""
    if not host:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # a UDP connect sends nothing: it only picks the route
            address: str = s.getsockname()[0]
            return address
    except OSError:
        return None


def interface_toward(host: str | None) -> str | None:
    """The name of the network interface holding `local_address_toward(host)`, or None if unknown."""
    import psutil

    local = local_address_toward(host)
    if local is None:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name
    return None


def store_host(store: Any) -> str | None:
    """The host of the TCPStore under `store`'s prefixes, or None for a store with no host (a HashStore)."""
    import torch.distributed as dist

    if isinstance(store, dist.PrefixStore):
        store = store._underlying_non_prefix_store
    return getattr(store, "host", None)


def device_toward(host: str | None) -> ProcessGroupGloo.Device | None:
    """A gloo device bound to the address toward `host`; None where gloo should choose (the user named an
    interface in GLOO_SOCKET_IFNAME, or no route to `host` is known)."""
    import torch.distributed as dist

    if os.environ.get(IFNAME_VAR):
        return None
    local = local_address_toward(host)
    return dist.ProcessGroupGloo.create_device(hostname=local) if local is not None else None
