"""`outlast start --worker-user USER`: a real rank runs as a throw-away user made for the test, and
reaches none of its node's state: not the key file, not the state directory, not the agent."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from outlast.client.discovery import start_agent_process
from outlast.protocol.auth import ClusterKey
from outlast.train import RunConfig, ScalingConfig, Trainer
from tests.integration.test_worker_secrets import look_for_secrets, parent_of

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                reason="--worker-user needs root (the agent changes its workers' user) and useradd(8) "
                                       "to make a throw-away user")

# What a rank imports after it dropped to the worker user. Here the interpreter lives under /root
# (0700), which the worker user cannot read: so the fork server imports them first, as root.
PRELOAD = ["outlast.train.worker_main", "outlast.train._session", "outlast.train.context", "outlast.train.watch",
           "tests.integration.test_worker_user", "inspect", "tempfile", "shutil"]


@pytest.fixture
def worker_user():
    name = f"olw{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", "--remove", name], capture_output=True)


def try_everything(config):
    """In a rank: who am I, and what of the node's can I reach?"""
    fork_server = parent_of(os.getpid())
    agent = parent_of(fork_server)
    reached = {}
    for what, attempt in (
        ("key file", lambda: Path(config["key_file"]).read_bytes()),
        ("state directory", lambda: os.listdir(config["home"])),
        ("node file", lambda: Path(config["home"], "node.json").read_bytes()),
        ("agent's environment", lambda: Path(f"/proc/{agent}/environ").read_bytes()),
        ("fork server's memory", lambda: Path(f"/proc/{fork_server}/mem").open("rb").read(1)),
        ("signal the agent", lambda: os.kill(agent, 0)),
        ("signal the fork server", lambda: os.kill(fork_server, 0)),
    ):
        try:
            attempt()
            reached[what] = True
        except PermissionError:
            reached[what] = False
    out = Path(config["dir"])
    look_for_secrets({"out": str(out / "secrets.json"), "agent": config["agent"]})
    (out / "me.json").write_text(json.dumps({
        "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "home": os.environ.get("HOME"), "outlast_home": os.environ.get("OUTLAST_HOME"), "reached": reached}))
    if config.get("fail"):
        raise ValueError("a rank that fails as the worker user")


def test_a_worker_run_as_another_user_reaches_nothing_of_its_nodes(tmp_path, worker_user, monkeypatch):
    home = tmp_path / "node-home"
    home.mkdir(mode=0o700)
    key = ClusterKey.generate()
    key_file = home / "cluster.key"
    key.save(key_file)
    # Where the rank says what it found, and the run's storage: the worker user's to write.
    out = Path(tempfile.mkdtemp(prefix="outlast-worker-user-"))
    os.chown(out, worker_user.pw_uid, worker_user.pw_gid)
    monkeypatch.setenv("OUTLAST_HOME", str(home))
    proc, address = start_agent_process(PRELOAD, embedded=False, extra_args=[
        "--die-with-parent", "--cluster-key", str(key_file), "--worker-user", worker_user.pw_name])
    try:
        monkeypatch.setenv("OUTLAST_ADDRESS", address)
        monkeypatch.setenv("OUTLAST_CLUSTER_KEY", str(key_file))
        monkeypatch.setenv("OUTLAST_HOME", str(tmp_path / "driver-home"))
        config = {"dir": str(out), "key_file": str(key_file), "home": str(home), "agent": address}
        Trainer(try_everything, train_loop_config=config, scaling_config=ScalingConfig(num_workers=1),
                run_config=RunConfig(name="worker-user", storage_path=str(out / "storage"))).fit()
        me = json.loads((out / "me.json").read_text())
        assert (me["uid"], me["euid"], me["gid"]) == (worker_user.pw_uid, worker_user.pw_uid, worker_user.pw_gid)
        assert 0 not in me["groups"]
        assert me["home"] == worker_user.pw_dir and me["outlast_home"] is None
        assert me["reached"] == dict.fromkeys(me["reached"], False)
        secrets = json.loads((out / "secrets.json").read_text())
        assert secrets["found"] == {} and secrets["answered"] == []

        # A rank that fails as the worker user still reports its error (written through the fd
        # the fork server opened for it), and the run's failure names it.
        from outlast.errors import TrainingFailedError

        with pytest.raises(TrainingFailedError, match="a rank that fails as the worker user"):
            Trainer(try_everything, train_loop_config={**config, "fail": True},
                    scaling_config=ScalingConfig(num_workers=1),
                    run_config=RunConfig(name="worker-user-fails", storage_path=str(out / "storage"))).fit()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(out, ignore_errors=True)


def test_worker_user_is_refused_saying_why_when_the_user_is_unknown_or_root(tmp_path):
    for name, why in (("no-such-user-outlast", "no such user"), ("root", "that is root")):
        done = subprocess.run([sys.executable, "-m", "outlast.agent", "--worker-user", name],
                              env={**os.environ, "OUTLAST_HOME": str(tmp_path / "h")}, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 3 and why in done.stderr, done.stderr
