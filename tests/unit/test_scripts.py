"""The README's two commands: the demo sets up only what it needs (a virtual environment), and the
tests' set-up is the one that installs the test servers; CI runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commands(script: str) -> list[str]:
    lines = (ROOT / "scripts" / script).read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_the_readme_gives_the_demo_and_test_commands_that_ci_runs():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    assert [line.split()[0] for line in block.splitlines() if line.strip()] == ["./scripts/demo", "./scripts/test"]
    assert "./scripts/test" in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_demo_sets_up_only_the_virtual_environment():
    demo = commands("demo")
    assert "./scripts/setup-venv" in demo and "./scripts/setup" not in demo
    venv = " ".join(commands("setup-venv"))
    for system_wide in ("apt-get", "setup-slurm", "setup-etcd", "sudo", "[test]", ",test]"):
        assert system_wide not in venv, f"scripts/setup-venv runs {system_wide}: the demo must not install it"


def test_the_test_setup_installs_the_test_tools_and_servers():
    assert "./scripts/setup" in commands("test")
    setup = commands("setup")
    assert "./scripts/setup-venv" in setup and any(",test]" in c for c in setup)
    assert "./scripts/setup-slurm" in setup and "./scripts/setup-etcd" in setup
