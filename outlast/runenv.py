"""Which environment variables a run's workers get.

A worker starts from its node's own environment (what its agent was started with: PATH,
LD_LIBRARY_PATH, CUDA_VISIBLE_DEVICES belong to that machine), then gets what the run carries:
the driver's outlast settings (OUTLAST_*, which tune the run itself) and the variables the user
names in `RunConfig(worker_runtime_env={"env_vars": {...}})`, Ray's `runtime_env` convention.
Nothing else of the driver's environment travels, and no cluster secret reaches a worker.
"""

from __future__ import annotations

import json
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
# What no process that forks user code holds in its environment: the key to the whole cluster,
# etcd's password. They reach the agent over a pipe (`write_secrets`, `read_secrets`), never in
# an environment block: `/proc/PID/environ` shows the block a process was exec'd with, whatever
# it removes from `os.environ` later, and any process of the same user can read it.
SECRETS = frozenset({"OUTLAST_CLUSTER_SECRET", "OUTLAST_ETCD_PASSWORD"})
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


def carried_env(driver_env: Mapping[str, str], runtime_env: Mapping[str, Mapping[str, str]] | None) -> dict[str, str]:
    """What the run carries to every worker (pure; `runtime_env` already checked)."""
    carried = {k: v for k, v in driver_env.items() if k.startswith("OUTLAST_") and k not in _NOT_CARRIED}
    carried.update((runtime_env or {}).get("env_vars", {}))
    return carried


def worker_env(node_env: Mapping[str, str], carried: Mapping[str, str]) -> dict[str, str]:
    """A worker's environment: its node's, less the cluster's secret, then what the run carries."""
    env = without_secrets(node_env)
    env.update(carried)
    return env


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in SECRETS}


def secrets_in(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k in SECRETS and v}


def write_secrets(secrets: Mapping[str, str]) -> int:
    """A pipe holding `secrets`, its write end closed: returns the read end, inheritable, for a
    child's `--secrets-fd` (a few hundred bytes: far below a pipe's buffer, so this never blocks)."""
    r, w = os.pipe()
    try:
        os.write(w, json.dumps(dict(secrets)).encode())
    finally:
        os.close(w)
    os.set_inheritable(r, True)
    return r


def read_secrets(fd: int) -> dict[str, str]:
    """What `write_secrets` put in the pipe; closes it."""
    chunks = []
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(65536):
            chunks.append(chunk)
    data = json.loads(b"".join(chunks) or b"{}")
    if not isinstance(data, dict) or not set(data) <= SECRETS:
        raise ValueError(f"--secrets-fd {fd}: expected a JSON object of {', '.join(sorted(SECRETS))}")
    return {str(k): str(v) for k, v in data.items()}


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
