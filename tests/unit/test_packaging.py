"""The systemd unit in packaging/: restarts the agent, delegates cgroups, and runs a command
`outlast start` accepts; `systemd-analyze verify` passes where systemd is installed."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from outlast.cli.main import build_parser

UNIT = Path(__file__).resolve().parents[2] / "packaging" / "systemd" / "outlast-node.service"


def _service() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text().replace("\\\n", " "))
    return parser["Service"]


def test_the_unit_restarts_the_agent_and_delegates_its_cgroup():
    service = _service()
    assert service["Restart"] == "always"
    assert service["Delegate"] == "yes"
    assert service["KillMode"] == "mixed"  # SIGTERM to the agent alone: it drains before workers stop


def test_the_units_command_is_one_outlast_start_accepts():
    argv = shlex.split(_service()["ExecStart"].replace("$OUTLAST_NODE_ARGS", "").replace("%H", "host-1"))
    assert argv[0].endswith("/outlast")
    args = build_parser().parse_args(argv[1:])
    assert args.func.__name__ == "cmd_start" and args.block and args.port == 6380 and args.node_id == "host-1"
    assert args.cluster_key == "/var/lib/outlast/cluster.key"


def test_systemd_analyze_verifies_the_unit(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here; the two tests above still check the unit")
    outlast = Path(sys.executable).with_name("outlast")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/outlast/bin/outlast", str(outlast)))
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
