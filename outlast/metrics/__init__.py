"""Prometheus metrics: where an endpoint listens, and serving a registry there.

The agent (`outlast/agent/metrics.py`: the node) and the driver (`outlast/controller/metrics.py`:
its runs) each define their metrics on a registry of their own and serve it with the official
client library's HTTP server. Off unless a port is given; loopback unless a host is.
Names follow Prometheus's conventions: `outlast_` prefix, base units (seconds, bytes), `_total`
for counters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NODE_PORT_VAR = "OUTLAST_METRICS_PORT"  # a node agent's endpoint (`outlast start --metrics-port`)
DRIVER_PORT_VAR = "OUTLAST_DRIVER_METRICS_PORT"  # the driver's (its controller's runs)
HOST_VAR = "OUTLAST_METRICS_HOST"
DEFAULT_HOST = "127.0.0.1"


class MetricsError(RuntimeError):
    """Metrics asked for but not possible: the library missing, a bad port, a port taken."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int  # 0: any free port


def endpoint(port: int | str | None, host: str | None = None, what: str = "--metrics-port") -> Endpoint | None:
    """None when `port` is None or empty (metrics off); raises MetricsError for a port that is not one."""
    if port is None or port == "":
        return None
    try:
        number = int(port)
    except ValueError:
        raise MetricsError(f"{what} must be a port number (0 for any free port), got {port!r}") from None
    if not 0 <= number <= 65535:
        raise MetricsError(f"{what} must be between 0 and 65535, got {number}")
    return Endpoint(host or DEFAULT_HOST, number)


def endpoint_from_env(port_var: str, env: Mapping[str, str] = os.environ) -> Endpoint | None:
    return endpoint(env.get(port_var), env.get(HOST_VAR), what=port_var)


def prometheus() -> Any:
    """The `prometheus_client` module, or an error that says how to install it."""
    try:
        import prometheus_client
    except ImportError:
        raise MetricsError("metrics need the prometheus_client library: pip install 'outlast[metrics]'") from None
    return prometheus_client


def serve(registry: Any, where: Endpoint) -> tuple[Any, str]:
    """Serve `registry` at http://HOST:PORT/metrics from a thread of the library's; returns the
    server (to shut down) and its URL."""
    client = prometheus()
    try:
        server, _thread = client.start_http_server(where.port, addr=where.host, registry=registry)
    except OSError as e:
        raise MetricsError(f"cannot serve metrics on {where.host}:{where.port} ({e.strerror}): choose another port "
                           f"(0 for any free one)") from None
    host, port = server.server_address[:2]
    return server, f"http://{_url_host(host)}:{port}/metrics"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
