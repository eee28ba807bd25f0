"""The state directory and the cluster key file are this user's alone, and say how to fix them."""

from __future__ import annotations

import os
import stat

import pytest

from outlast.protocol.auth import AuthError, ClusterKey
from outlast.statedir import UnsafeStateError, state_dir

NOBODY = 65534


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_default_state_directory_is_private_in_the_users_home(tmp_path):
    where = state_dir({"HOME": str(tmp_path)})
    assert where == tmp_path / ".outlast"
    assert mode(where) == 0o700


def test_a_default_state_directory_open_to_others_is_refused_saying_how_to_fix_it(tmp_path):
    (tmp_path / ".outlast").mkdir(mode=0o755)
    os.chmod(tmp_path / ".outlast", 0o755)
    with pytest.raises(UnsafeStateError, match=r"mode is 0755: group or others have access .* Fix: `chmod 700 "):
        state_dir({"HOME": str(tmp_path)})


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_state_directory_owned_by_someone_else_is_refused(tmp_path):
    (tmp_path / ".outlast").mkdir(mode=0o700)
    os.chown(tmp_path / ".outlast", NOBODY, NOBODY)
    with pytest.raises(UnsafeStateError, match=rf"belongs to uid {NOBODY}, not to you"):
        state_dir({"HOME": str(tmp_path)})


def test_a_state_directory_owned_by_another_uid_is_refused_whoever_runs_the_test(tmp_path):
    (tmp_path / "home").mkdir(mode=0o700)
    with pytest.raises(UnsafeStateError, match=r"belongs to uid \d+, not to you \(uid 4242\)"):
        state_dir({"OUTLAST_HOME": str(tmp_path / "home")}, uid=4242)


def test_outlast_home_may_be_readable_by_others_but_not_writable(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    os.chmod(home, 0o755)
    assert state_dir({"OUTLAST_HOME": str(home)}) == home
    os.chmod(home, 0o777)
    with pytest.raises(UnsafeStateError, match=r"mode is 0777"):
        state_dir({"OUTLAST_HOME": str(home)})


def test_a_symlinked_state_directory_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", tmp_path / ".outlast")
    with pytest.raises(UnsafeStateError, match="symbolic link"):
        state_dir({"HOME": str(tmp_path)})


def test_a_key_saved_over_a_readable_file_ends_up_private(tmp_path):
    path = tmp_path / "cluster.key"
    path.write_text("old")
    os.chmod(path, 0o644)
    key = ClusterKey.generate()
    key.save(path)
    assert mode(path) == 0o600
    assert ClusterKey.load(path).secret == key.secret


def test_a_key_file_others_can_read_is_refused_like_ssh_refuses_a_private_key(tmp_path):
    path = tmp_path / "cluster.key"
    ClusterKey.generate().save(path)
    os.chmod(path, 0o640)
    with pytest.raises(AuthError, match=rf"the cluster key {path} is not private: its mode is 0640.*chmod 600"):
        ClusterKey.load(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_key_file_owned_by_someone_else_is_refused(tmp_path):
    path = tmp_path / "cluster.key"
    ClusterKey.generate().save(path)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(AuthError, match=rf"belongs to uid {NOBODY}"):
        ClusterKey.load(path)


def test_a_0755_outlast_home_is_accepted_and_what_outlast_keeps_in_it_is_still_0700(tmp_path, monkeypatch):
    from outlast.statedir import private_subdir
    from outlast.train._session import _default_cache

    home = tmp_path / "shared-home"
    home.mkdir()
    home.chmod(0o755)
    monkeypatch.setenv("OUTLAST_HOME", str(home))
    (home / "logs").mkdir()
    (home / "logs").chmod(0o755)  # left by an older outlast
    cache = _default_cache()
    assert cache == home / "checkpoint_cache"
    for path in (cache, private_subdir("logs"), private_subdir("agents")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE(home.stat().st_mode) == 0o755  # the home itself is the user's: left as it is
