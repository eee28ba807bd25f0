"""The catalogue of bad inputs: each row is an input a user can give and the error it must get.

Every bad input gets an error that says what is wrong and what to do, and loses nothing. Add a
row whenever an input is found that was accepted and wrong, or refused with a raw error.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from pathlib import Path

import pytest

from outlast import Executor
from outlast.cli.main import main as cli_main
from outlast.client import discovery
from outlast.storage import StorageError, open_storage
from outlast.storage.run_store import RunStore
from outlast.train.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from outlast.train.trainer import DataParallelTrainer


class CliRefused(Exception):
    """A CLI command exited non-zero; the message is what it printed on stderr."""


def cli(*argv: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        cli_main(list(argv))
    if exit_.value.code not in (0, None):
        raise CliRefused(err.getvalue())


def cli_in(tmp: Path, mode: int, *argv: str) -> None:
    """The CLI with $OUTLAST_HOME at a directory of this mode."""
    home = tmp / "home"
    home.mkdir()
    os.chmod(home, mode)
    saved = os.environ.get("OUTLAST_HOME")
    os.environ["OUTLAST_HOME"] = str(home)
    try:
        cli(*argv)
    finally:
        os.environ["OUTLAST_HOME"] = saved or ""


def storage_under(tmp: Path, make) -> None:
    RunStore(open_storage(make(tmp)), "run").check_writable()


def fit_under(tmp: Path, make) -> None:
    DataParallelTrainer(lambda: None, run_config=RunConfig(name="run", storage_path=make(tmp))).fit()


def _a_file(tmp: Path) -> str:
    (tmp / "file").write_text("x")
    return str(tmp / "file" / "runs")


def _read_only_dir(tmp: Path) -> str:
    (tmp / "ro").mkdir()
    os.chmod(tmp / "ro", 0o500)
    return str(tmp / "ro" / "runs")


CATALOGUE = [
    # (id, input as a function of a temporary directory, error type, what the message must say)
    ("run name ..", lambda t: RunConfig(name=".."), ValueError, r"RunConfig\(name=\.\.\.\) is '\.\.': .* other than '\.' and '\.\.'"),
    ("run name .", lambda t: RunConfig(name="."), ValueError, r"RunConfig\(name=\.\.\.\) is '\.'"),
    ("run name with /", lambda t: RunConfig(name="a/b"), ValueError, r"RunConfig\(name='a/b'\) has a '/': .* without '/'"),
    ("run name empty", lambda t: RunConfig(name=""), ValueError, r"RunConfig\(name=\.\.\.\) is empty"),
    ("run name with NUL", lambda t: RunConfig(name="a\0b"), ValueError,
     r"RunConfig\(name=.*\) has the control character '\\x00'"),
    ("storage_path a number", lambda t: RunConfig(storage_path=3), ValueError, r"RunConfig\.storage_path"),
    ("failure_config a dict", lambda t: RunConfig(failure_config={"max_failures": 3}), TypeError,
     r"RunConfig\.failure_config must be a FailureConfig, got a dict: write "
     r"failure_config=FailureConfig\(\*\*\{'max_failures': 3\}\)"),
    ("checkpoint_config a dict", lambda t: RunConfig(checkpoint_config={"num_to_keep": 2}), TypeError,
     r"RunConfig\.checkpoint_config must be a CheckpointConfig"),
    ("failure_config a number", lambda t: RunConfig(failure_config=3), TypeError,
     r"RunConfig\.failure_config must be a FailureConfig, got int"),
    ("worker_runtime_env a list", lambda t: RunConfig(worker_runtime_env=["A=1"]), TypeError,
     r'RunConfig\.worker_runtime_env must be a dict like \{"env_vars": \{"NAME": "value"\}\}'),
    ("worker_runtime_env pip", lambda t: RunConfig(worker_runtime_env={"pip": ["torch"]}), ValueError,
     r"fields outlast does not support: 'pip'; only 'env_vars' is"),
    ("env_vars value a number", lambda t: RunConfig(worker_runtime_env={"env_vars": {"N": 3}}), TypeError,
     r"\[\"env_vars\"\]\['N'\] must be a string, got 3; write str\(value\)"),
    ("env_vars name with =", lambda t: RunConfig(worker_runtime_env={"env_vars": {"A=B": "1"}}), ValueError,
     r"invalid variable name 'A=B'"),
    ("env_vars sets the cluster secret", lambda t: RunConfig(worker_runtime_env={"env_vars": {
        "OUTLAST_CLUSTER_SECRET": "x"}}), ValueError, r"may not set OUTLAST_CLUSTER_SECRET: it belongs to the node"),
    ("state dir open to all", lambda t: cli_in(t, 0o777, "status"), CliRefused,
     r"state directory .* is not private: its mode is 0777.*Fix: `chmod 755 "),
    ("use_gpu a string", lambda t: ScalingConfig(use_gpu="yes"), ValueError,
     r"ScalingConfig\.use_gpu must be True or False"),
    ("use_gpu 1", lambda t: ScalingConfig(use_gpu=1), ValueError, r"ScalingConfig\.use_gpu"),
    ("num_workers 0", lambda t: ScalingConfig(num_workers=0), ValueError,
     r"ScalingConfig\.num_workers must be an integer >= 1"),
    ("num_workers True", lambda t: ScalingConfig(num_workers=True), ValueError, r"ScalingConfig\.num_workers"),
    ("placement lower case", lambda t: ScalingConfig(placement_strategy="pack"), ValueError,
     r"ScalingConfig\.placement_strategy must be PACK, SPREAD"),
    ("resource amount nan", lambda t: ScalingConfig(resources_per_worker={"CPU": math.nan}), ValueError,
     r"resources_per_worker\['CPU'\] must be a finite number >= 0"),
    ("resource amount inf", lambda t: ScalingConfig(resources_per_worker={"CPU": math.inf}), ValueError,
     r"resources_per_worker\['CPU'\] must be a finite number >= 0, got inf"),
    ("resources_per_worker a string", lambda t: ScalingConfig(resources_per_worker="CPU=1"), ValueError,
     r'resources_per_worker must be a dict like \{"CPU": 2, "GPU": 1\}'),
    ("resource name not a string", lambda t: ScalingConfig(resources_per_worker={1: 1}), ValueError,
     r"has a resource name 1; names are strings"),
    ("relax_collectives a string", lambda t: FailureConfig(relax_collectives_on_preemption="yes"), ValueError,
     r"relax_collectives_on_preemption must be True or False"),
    ("score attribute a number", lambda t: CheckpointConfig(checkpoint_score_attribute=3), ValueError,
     r"checkpoint_score_attribute must be the name of a reported metric"),
    ("trainer scaling_config a dict", lambda t: DataParallelTrainer(lambda: None, scaling_config={"num_workers": 2}),
     TypeError, r"scaling_config must be a ScalingConfig, got dict: write scaling_config=ScalingConfig\(\*\*"),
    ("trainer run_config a dict", lambda t: DataParallelTrainer(lambda: None, run_config={"name": "x"}),
     TypeError, r"run_config must be a RunConfig, got dict"),
    ("executor num_cpus nan", lambda t: Executor(num_cpus=math.nan), ValueError,
     r"num_cpus must be a positive finite number, got nan"),
    ("executor num_cpus 0", lambda t: Executor(num_cpus=0), ValueError, r"num_cpus must be a positive finite number"),
    ("executor max_workers 0", lambda t: Executor(max_workers=0), ValueError, r"max_workers must be at least 1"),
    ("executor memory not a size", lambda t: Executor(memory="lots"), ValueError,
     r"memory 'lots' is not a size; write e.g. 2GiB"),
    ("preemption_grace_s inf", lambda t: FailureConfig(preemption_grace_s=math.inf), ValueError,
     r"preemption_grace_s must be a finite number of seconds >= 0"),
    ("preemption_grace_s nan", lambda t: FailureConfig(preemption_grace_s=math.nan), ValueError, r"preemption_grace_s"),
    ("preemption_grace_s negative", lambda t: FailureConfig(preemption_grace_s=-1), ValueError, r"preemption_grace_s"),
    ("max_failures -2", lambda t: FailureConfig(max_failures=-2), ValueError,
     r"FailureConfig\.max_failures must be an integer >= -1"),
    ("num_to_keep 0", lambda t: CheckpointConfig(num_to_keep=0), ValueError, r"CheckpointConfig\.num_to_keep"),
    ("score order", lambda t: CheckpointConfig(checkpoint_score_order="up"), ValueError,
     r"checkpoint_score_order must be"),
    ("drain deadline nan", lambda t: cli("drain-node", "--node-id", "n", "--deadline-remaining-seconds", "nan"),
     CliRefused, r"--deadline-remaining-seconds must be a finite number of seconds >= 0, got nan; leave it out"),
    ("drain deadline inf", lambda t: cli("drain-node", "--node-id", "n", "--deadline-remaining-seconds", "inf"),
     CliRefused, r"--deadline-remaining-seconds must be a finite number"),
    ("drain deadline negative", lambda t: cli("drain-node", "--node-id", "n", "--deadline-remaining-seconds", "-1"),
     CliRefused, r"--deadline-remaining-seconds must be"),
    ("storage_path under a file", lambda t: storage_under(t, _a_file), StorageError,
     r"cannot write the run's directory .*file/runs/run: Not a directory\. RunConfig\(storage_path=\.\.\.\)"),
    ("fit with storage_path under a file", lambda t: fit_under(t, _a_file), StorageError,
     r"cannot write the run's directory .*file/runs/run: Not a directory\. RunConfig\(storage_path=\.\.\.\) "
     r"\(or \$OUTLAST_STORAGE_PATH\) must name a directory you can write"),
]

if os.geteuid() != 0:  # root writes anywhere
    CATALOGUE.append(("storage_path read-only", lambda t: storage_under(t, _read_only_dir), StorageError,
                      r"cannot write the run's directory .*ro/runs/run: Permission denied\. RunConfig"))


@pytest.mark.parametrize(("make", "error", "says"), [row[1:] for row in CATALOGUE], ids=[row[0] for row in CATALOGUE])
def test_a_bad_input_gets_an_error_that_says_what_to_do(tmp_path, make, error, says):
    with pytest.raises(error, match=says):
        make(tmp_path)


def test_the_storage_check_leaves_nothing_behind_in_a_writable_run_directory(tmp_path):
    RunStore(open_storage(tmp_path), "run").check_writable()
    assert list((tmp_path / "run").iterdir()) == []


def test_a_node_file_larger_than_an_agent_writes_is_not_read_whole(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OUTLAST_HOME", str(tmp_path))
    path = discovery.node_file_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b'{"pid": 1' + b" " * (discovery.NODE_FILE_MAX_BYTES + 1) + b"}")
    assert discovery.read_node_file() is None
    assert "larger than a node file can be" in caplog.text
