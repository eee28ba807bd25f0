"""Which environment variables a run's workers get.

A worker starts from its node's own environment (what its agent was started with: PATH,
LD_LIBRARY_PATH, CUDA_VISIBLE_DEVICES belong to that machine), then gets what the run carries:
the driver's outlast settings (OUTLAST_*, which tune the run itself) and the variables the user
names in `RunConfig(worker_runtime_env={"env_vars": {...}})`, Ray's `runtime_env` convention.
Nothing else of the driver's environment travels, and no cluster secret reaches a worker.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

# Machine-local or secret: meaningless or dangerous on another node.
_NOT_CARRIED = frozenset({
    "OUTLAST_HOME", "OUTLAST_ADDRESS", "OUTLAST_CLUSTER_KEY", "OUTLAST_CLUSTER_SECRET", "OUTLAST_RUN_CREDENTIAL",
    # The cluster store's client settings: a worker never talks to etcd.
    "OUTLAST_ETCD", "OUTLAST_ETCD_CACERT", "OUTLAST_ETCD_CERT", "OUTLAST_ETCD_KEY", "OUTLAST_ETCD_USER",
    "OUTLAST_ETCD_PASSWORD", "OUTLAST_ETCD_LEASE_TTL_S",
})
# What a worker's environment never holds, whatever its node's has: the key to the whole cluster, etcd's password.
_NEVER_IN_A_WORKER = frozenset({"OUTLAST_CLUSTER_SECRET", "OUTLAST_ETCD_PASSWORD"})
_KNOWN_FIELDS = ("env_vars",)


def check_runtime_env(value: object, name: str = "RunConfig.worker_runtime_env") -> None:
    """Raise with what to write instead when `value` is not {"env_vars": {str: str}} (or None)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f'{name} must be a dict like {{"env_vars": {{"NAME": "value"}}}}, got {type(value).__name__}')
    unknown = sorted(set(value) - set(_KNOWN_FIELDS))
    if unknown:
        raise ValueError(f"{name} has fields outlast does not support: {', '.join(map(repr, unknown))}; "
                         "only 'env_vars' is: workers run in the driver's working directory with its import path, "
                         "on the packages installed on their node (install packages there)")
    env_vars = value.get("env_vars", {})
    if not isinstance(env_vars, dict):
        raise TypeError(f'{name}["env_vars"] must be a dict of names to strings, got {type(env_vars).__name__}')
    for key, val in env_vars.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ValueError(f'{name}["env_vars"] has an invalid variable name {key!r}')
        if not isinstance(val, str) or "\0" in val:
            raise TypeError(f'{name}["env_vars"][{key!r}] must be a string, got {val!r}; write str(value)')
        if key in _NOT_CARRIED:
            raise ValueError(f'{name}["env_vars"] may not set {key}: it belongs to the node, not the run')


def carried_env(driver_env: Mapping[str, str], runtime_env: dict | None) -> dict[str, str]:
    """What the run carries to every worker (pure; `runtime_env` already checked)."""
    carried = {k: v for k, v in driver_env.items() if k.startswith("OUTLAST_") and k not in _NOT_CARRIED}
    carried.update((runtime_env or {}).get("env_vars", {}))
    return carried


def worker_env(node_env: Mapping[str, str], carried: Mapping[str, str]) -> dict[str, str]:
    """A worker's environment: its node's, less the cluster's secret, then what the run carries."""
    env = {k: v for k, v in node_env.items() if k not in _NEVER_IN_A_WORKER}
    env.update(carried)
    return env


def importable_paths() -> list[str]:
    """Where this process imports the user's modules from (the main script's directory, the
    working directory, sys.path), so that workers and tasks import them the same way. Installed
    packages are left out: a worker uses the environment of its node."""
    paths = [os.getcwd()]
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file:
        paths.insert(0, os.path.dirname(os.path.abspath(main_file)))
    return paths + [p for p in sys.path if p and "site-packages" not in p and "dist-packages" not in p
                    and p not in paths]
