"""Which errors out of an FSDP2 step under live recovery void the step (a peer gone) and which are the loop's own
(`outlast/train/torch/live_mesh.py`'s `is_peer_loss`)."""

from __future__ import annotations

import pytest

from outlast.train.live.group import GroupBroken
from outlast.train.torch.live_mesh import is_peer_loss


@pytest.mark.parametrize("error", [
    RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                 "[127.0.0.1]:35033"),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:53455: Connection "
                 "reset by peer"),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv"),
    GroupBroken("live-shards-of-replica0: no group of this generation"),
])
def test_a_collective_failed_by_a_peer_s_loss_voids_the_step(error):
    assert is_peer_loss(error)


@pytest.mark.parametrize("error", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (16x8 and 4x32)"),
    ValueError("Connection closed by peer"),  # not a collective's error, whatever it says
    KeyError("gloo/transport"),
])
def test_the_loop_s_own_errors_go_up(error):
    assert not is_peer_loss(error)


def test_a_mesh_of_shards_that_do_not_divide_the_world_is_refused_before_anything_is_made():
    pytest.importorskip("torch")
    from outlast.train.torch.live_mesh import make_mesh

    with pytest.raises(ValueError, match=r"live_mesh\(shards=3\): the world's 4 ranks must be a whole number"):
        make_mesh(0, 4, 3, store=None)


def test_a_mesh_asked_for_beside_a_default_group_already_made_is_refused(tmp_path):
    # In a process of its own: the default group is the process's, and this test's must not keep one.
    import subprocess
    import sys

    pytest.importorskip("torch")
    code = (
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'rdv'}', rank=0, world_size=1)\n"
        "from outlast.train.torch.live_mesh import make_mesh\n"
        "try:\n"
        "    make_mesh(0, 1, 1, dist.HashStore())\n"
        "except RuntimeError as e:\n"
        "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "do not call init_process_group in this mode" in out.stdout, out.stderr[-2000:]
