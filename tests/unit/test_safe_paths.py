"""Paths in messages are relative and inside their root when decoded, and files are opened under their root
without following a link out of it."""

import os
from pathlib import Path

import msgspec
import pytest

from outlast.protocol import messages as m
from outlast.protocol import paths
from outlast.protocol.transport import AGENT_REQUESTS, HEADER, TIER_REQUESTS, WORKER_MESSAGES, BadMessage
from outlast.storage import safepath
from outlast.storage.memtier import CopyKey
from outlast.storage.tier_store import copy_dir

DIGEST = "0" * 32


def raw(kind: str, **fields) -> bytes:
    """A frame as a peer that builds its own bytes sends it: nothing checked on the way out."""
    return HEADER + msgspec.msgpack.encode({"type": kind, **fields})


def chunk(path: str, checkpoint_dir: str = "checkpoint_000_000001") -> bytes:
    return raw("TierChunk", run="r", checkpoint_dir=checkpoint_dir, rank=0, path=path, offset=0)


def hold(path: str = "model.pt", source_dir: str = "/tmp/ckpt", checkpoint_dir: str = "checkpoint_000_000001"):
    return raw("TierHold", run="r", checkpoint_dir=checkpoint_dir, rank=0, seq=1, source_dir=source_dir,
               files=[{"path": path, "size": 1, "xxh3_128": DIGEST}])


REFUSED_PATHS = {
    "": "empty",
    "/etc/passwd": "absolute",
    "..": "'..'",
    "../escaped.txt": "'..'",
    "../../../../../escaped.txt": "'..'",
    "sub/../../x": "'..'",
    ".": "'.'",
    "./model.pt": "'.'",
    "sub/./model.pt": "'.'",
    "sub//model.pt": "empty component",
    "sub/": "empty component",
    "model\0.pt": "NUL",
    "x" * 4097: "longer than 4096 bytes",
    "/".join(["d"] * 65): "65 components deep",
    "sub/" + "x" * 256: "longer than 255 bytes",
}


@pytest.mark.parametrize("path", list(REFUSED_PATHS), ids=[repr(p[:24]) for p in REFUSED_PATHS])
def test_a_file_path_that_could_leave_its_directory_is_refused_when_decoded_on_every_tier_request(path):
    for frame in (hold(path), chunk(path),
                  raw("TierOffer", run="r", checkpoint_dir="c", rank=0, seq=1,
                      files=[{"path": path, "size": 1, "xxh3_128": DIGEST}]),
                  raw("TierFetch", run="r", checkpoint_dir="c", rank=0, path=path) if path else chunk(path)):
        with pytest.raises(BadMessage, match=REFUSED_PATHS[path]):
            TIER_REQUESTS.decode(frame)


@pytest.mark.parametrize("path", ["model.pt", "sub/dir/opt.pt", "a..b", ".hidden", "...", "x" * 255,
                                  "/".join(["d"] * 63 + ["f"]), "ünïcode/名前.bin"])
def test_a_relative_path_inside_its_directory_is_accepted_however_nested(path):
    decoded = TIER_REQUESTS.decode(hold(path))
    assert decoded.files[0].path == path
    assert TIER_REQUESTS.decode(chunk(path)).path == path


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "a\0b", "x" * 256])
def test_a_checkpoint_name_that_is_not_one_directory_name_is_refused(name):
    with pytest.raises(BadMessage, match="cannot be one name in a directory"):
        TIER_REQUESTS.decode(hold(checkpoint_dir=name))
    with pytest.raises(BadMessage, match="cannot be one name in a directory"):
        WORKER_MESSAGES.decode(raw("Report", attempt=0, rank=0, index=0, metrics={}, checkpoint_dir=name))


@pytest.mark.parametrize("where", ["ckpt", "../ckpt", "/tmp/../etc", "/tmp//ckpt", "/tmp/ckpt/", "/tmp/./ckpt"])
def test_a_ranks_directory_must_be_absolute_and_normalised(where):
    with pytest.raises(BadMessage, match="not an absolute, normalised path"):
        TIER_REQUESTS.decode(hold(source_dir=where))
    with pytest.raises(BadMessage, match="local_dir"):
        WORKER_MESSAGES.decode(raw("Report", attempt=0, rank=0, index=0, metrics={}, checkpoint_dir="c",
                                   local_dir=where))


def test_a_report_naming_a_file_outside_its_checkpoint_says_which_field_and_why():
    frame = raw("Report", attempt=0, rank=1, index=0, metrics={}, checkpoint_dir="checkpoint_000_000000",
                files=[{"path": "ok.pt", "size": 1, "xxh3_128": DIGEST}, {"path": "../../x", "size": 1,
                                                                          "xxh3_128": DIGEST}])
    with pytest.raises(BadMessage) as e:
        WORKER_MESSAGES.decode(frame)
    assert "file '../../x' is not a relative path inside its directory" in str(e.value)
    assert "$.files[1]" in str(e.value)


@pytest.mark.parametrize("field", ["run_id", "run_name", "restore_checkpoint"])
def test_an_id_that_becomes_a_file_name_on_the_node_cannot_leave_its_directory(field):
    spawn = dict(run_id="run", attempt=0, controller_address="tcp://127.0.0.1:1", workers=[], payload=b"",
                 env={}, cwd="/", sys_path=[], run_name="name", restore_checkpoint=None)
    assert AGENT_REQUESTS.decode(raw("SpawnWorkers", **spawn)).run_id == "run"
    with pytest.raises(BadMessage, match="cannot be one name"):
        AGENT_REQUESTS.decode(raw("SpawnWorkers", **{**spawn, field: "../x"}))
    with pytest.raises(BadMessage, match="cannot be one name"):
        AGENT_REQUESTS.decode(raw("SpawnTask", run_id="run", task_id="../../t", controller_address="", payload=b"",
                                  env={}, cwd="/", sys_path=[]))


def test_a_message_built_in_process_with_a_bad_path_fails_at_once():
    with pytest.raises(ValueError, match="'..'"):
        m.FileEntry(path="../x", size=1)
    with pytest.raises(ValueError, match="cannot be one name"):
        m.TierCommit(run="r", checkpoint_dir="a/b")


def test_ids_joined_into_a_tier_path_are_single_names():
    assert copy_dir(Path("/t"), "n", CopyKey("r", "c", 0)).parent.name == "c"
    for node, name in (("..", "c"), ("n", "../c"), ("n/x", "c")):
        with pytest.raises(safepath.UnsafePath):
            copy_dir(Path("/t"), node, CopyKey("r", name, 0))


def test_paths_checks_agree_with_what_they_say():
    assert paths.relative_problem("a/b") is None and paths.name_problem("a") is None
    assert paths.absolute_problem("/") is None and paths.absolute_problem("/a/b") is None
    assert "absolute" in paths.absolute_problem("a")


# ---- opening under a root ----------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "sub/model.pt").write_bytes(b"model")
    (outside / "secret").write_bytes(b"secret")
    return root, outside


def test_a_file_under_its_root_is_read_and_written_and_copied(tree, tmp_path):
    root, _ = tree
    (tmp_path / "dst").mkdir()
    (tmp_path / "linked").mkdir()
    assert safepath.hash_under(root, "sub/model.pt", "sha256")[0] == 5
    safepath.copy_under(root, "sub/model.pt", tmp_path / "dst")
    assert (tmp_path / "dst/sub/model.pt").read_bytes() == b"model"
    safepath.link_under(root, "sub/model.pt", tmp_path / "linked")
    assert os.path.samefile(tmp_path / "linked/sub/model.pt", root / "sub/model.pt")


@pytest.mark.parametrize("plant", ["file", "dir"])
def test_a_link_under_the_root_is_never_followed_out_of_it(tree, tmp_path, plant):
    root, outside = tree
    (tmp_path / "dst").mkdir()
    if plant == "file":
        (root / "link.pt").symlink_to(outside / "secret")
        rel = "link.pt"
    else:
        (root / "out").symlink_to(outside)
        rel = "out/secret"
    for read in (lambda: safepath.open_under(root, rel), lambda: safepath.size_under(root, rel),
                 lambda: safepath.copy_under(root, rel, tmp_path / "dst"),
                 lambda: safepath.link_under(root, rel, tmp_path / "dst")):
        with pytest.raises(safepath.UnsafePath, match="goes through the link"):
            read()
    if plant == "dir":
        with pytest.raises(safepath.UnsafePath, match="goes through the link"):
            safepath.open_under(root, "out/new", write=True)
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_bytes() == b"secret"


def test_a_link_or_hard_link_planted_where_a_file_is_written_is_replaced_not_written_through(tree):
    root, outside = tree
    (root / "planted").symlink_to(outside / "secret")
    os.link(outside / "secret", root / "hard")
    for rel in ("planted", "hard"):
        fd = safepath.open_under(root, rel, write=True)
        os.write(fd, b"new")
        os.close(fd)
        assert (root / rel).read_bytes() == b"new" and not (root / rel).is_symlink()
    assert (outside / "secret").read_bytes() == b"secret"


def test_a_fifo_or_a_directory_is_not_a_file_to_read(tree):
    root, _ = tree
    os.mkfifo(root / "fifo")
    with pytest.raises(safepath.UnsafePath, match="not a regular file"):
        safepath.open_under(root, "fifo")  # at once: never waits for a writer
    with pytest.raises(safepath.UnsafePath, match="not a regular file"):
        safepath.open_under(root, "sub")


def test_a_path_the_message_check_refuses_is_refused_here_too(tree):
    root, _ = tree
    for rel in ("../outside/secret", "/etc/hostname", "sub/../sub/model.pt", ""):
        with pytest.raises(safepath.UnsafePath, match="not a relative path inside"):
            safepath.open_under(root, rel)


# ---- a root agent keeps only its workers' files -------------------------------------------------------

WORKER_UID = 54321


def test_a_file_of_another_user_is_refused_where_an_owner_is_asked(tree, tmp_path):
    root, _ = tree
    (tmp_path / "dst").mkdir()
    for read in (lambda: safepath.open_under(root, "sub/model.pt", owner=WORKER_UID),
                 lambda: safepath.copy_under(root, "sub/model.pt", tmp_path / "dst", owner=WORKER_UID),
                 lambda: safepath.link_under(root, "sub/model.pt", tmp_path / "dst", owner=WORKER_UID)):
        with pytest.raises(safepath.UnsafePath, match=f"belongs to uid {os.geteuid()}, not to the workers' user"):
            read()
    os.close(safepath.open_under(root, "sub/model.pt", owner=os.geteuid()))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root, as --worker-user does")
@pytest.mark.parametrize("link", [False, True])
def test_a_root_tier_refuses_a_hold_of_a_file_its_workers_user_did_not_write(tmp_path, link):
    import zmq

    from outlast.agent.tier_client import ask
    from outlast.agent.tier_server import TierServer
    from outlast.protocol.auth import ClusterKey, start_authenticator
    from outlast.storage.checksum import hash_file
    from outlast.storage.tier_store import TierStore

    src = tmp_path / "ckpt"
    src.mkdir()
    for name in ("rank.pt", "roots.pt"):
        (src / name).write_bytes(os.urandom(1000))
    os.chown(src / "rank.pt", WORKER_UID, WORKER_UID)
    ctx = zmq.Context()
    key = ClusterKey.generate()
    auth = start_authenticator(ctx, key)
    store = TierStore(tmp_path / "tier", "n1", 1 << 26)
    store.open()
    server = TierServer(ctx, key, store, source_owner=WORKER_UID).start()
    try:
        for name, ok in (("roots.pt", False), ("rank.pt", True)):
            hold = m.TierHold(run="r", checkpoint_dir=f"c-{name}", rank=0, seq=1, source_dir=str(src), link=link,
                              files=[m.FileEntry(path=name, size=1000, xxh3_128=hash_file(src / name)[1])])
            stored = ask(ctx, key, server.address, hold, timeout_s=30)
            assert stored.ok is ok, stored
            if not ok:
                assert f"belongs to uid 0, not to the workers' user (uid {WORKER_UID})" in stored.reason
    finally:
        server.stop()
        auth.stop()
        ctx.term()
