"""What a worker can reach of the cluster's secrets, tried from inside a real rank.

A rank reads the initial environment block of its own process, of its fork server and of its
agent (`/proc/PID/environ` is fixed at exec: clearing `os.environ` does not change it), and
tries every cluster key it finds there on its agent's control socket.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import zmq

from outlast.client.discovery import AgentUnavailable, request, start_agent_process
from outlast.protocol import messages as m
from outlast.protocol.auth import AuthError, ClusterKey
from outlast.train import RunConfig, ScalingConfig, Trainer

SECRETS = ("OUTLAST_CLUSTER_SECRET", "OUTLAST_ETCD_PASSWORD")


def environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def look_for_secrets(config):
    """In a rank: every secret in the environment blocks of this process and its ancestors up to
    the agent, and whether a cluster key found there opens the agent's control socket."""
    me = os.getpid()
    fork_server = parent_of(me)
    agent = parent_of(fork_server)
    found = {}
    for who, pid in (("worker", me), ("fork server", fork_server), ("agent", agent)):
        env = environ_of(pid)
        for name in SECRETS:
            if name in env:
                found[f"{who} {name}"] = env[name]
    answered = []
    for value in {v for k, v in found.items() if k.endswith("OUTLAST_CLUSTER_SECRET")}:
        ctx = zmq.Context()
        try:
            reply = request(ctx, config["agent"], m.StatusRequest(), timeout_s=5.0, key=ClusterKey(value.encode()))
            answered.append(type(reply).__name__)
        except (AgentUnavailable, AuthError):
            pass
        finally:
            ctx.term()
    Path(config["out"]).write_text(json.dumps({"found": found, "answered": answered,
                                               "pids": [me, fork_server, agent]}))


def test_a_node_started_with_secrets_in_its_environment_keeps_them_from_its_workers(tmp_path, storage_path,
                                                                                   monkeypatch):
    # A persistent node whose supervisor (systemd's Environment=, a Slurm step) hands it the
    # cluster key and etcd's password in its environment.
    key = ClusterKey.generate()
    key_file = tmp_path / "cluster.key"
    key.save(key_file)
    proc, address = start_agent_process([], embedded=False, extra_args=["--die-with-parent"],
                                        env={**key.env, "OUTLAST_ETCD_PASSWORD": "etcd-pass"})
    try:
        monkeypatch.setenv("OUTLAST_ADDRESS", address)
        monkeypatch.setenv("OUTLAST_CLUSTER_KEY", str(key_file))
        out = tmp_path / "found.json"
        Trainer(look_for_secrets, train_loop_config={"out": str(out), "agent": address},
                scaling_config=ScalingConfig(num_workers=1),
                run_config=RunConfig(name="secrets", storage_path=storage_path)).fit()
        seen = json.loads(out.read_text())
        assert seen["pids"][2] == proc.pid  # the rank did read its agent's environment block
        assert seen["found"] == {} and seen["answered"] == []
        # The agent still holds the key: the node answers who has it.
        ctx = zmq.Context()
        try:
            assert isinstance(request(ctx, address, m.StatusRequest(), timeout_s=5.0, key=key), m.StatusReply)
        finally:
            ctx.term()
    finally:
        proc.kill()
        proc.wait()


def test_an_embedded_nodes_workers_find_no_secret_in_any_environment_block(tmp_path, storage_path):
    out = tmp_path / "found.json"
    Trainer(look_for_secrets, train_loop_config={"out": str(out), "agent": "tcp://127.0.0.1:1"},
            scaling_config=ScalingConfig(num_workers=1),
            run_config=RunConfig(name="secrets-embedded", storage_path=storage_path)).fit()
    seen = json.loads(out.read_text())
    assert seen["found"] == {}
