"""The chaos harness's training job: deterministic DDP, importable by the workers.

Training is a pure function of (restored state, step), so the weights a run ends with do not
depend on how often it was interrupted. At any number of ranks: `prepare_model` lays DDP's gradient buckets out
before the first step, so that every process group reduces in the same order (docs/guide/failures.md, "Bit for bit"). The harness steers the job through files in
`config["orders"]`, never through its arguments (those must not change between the run with
faults and the run without):
- `pace`: seconds to sleep after each step while faults are being injected (absent: none);
- `spawn-<i>`: rank `<i's content>` starts a daemon of its own (`setsid`, reparented away from
  it), logs its pid and claims the order by creating `spawned-<i>`.
On a drain notice rank 0 saves a checkpoint at once and reports it SYNC, so that a drain costs no step.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time

from outlast import train
from outlast.train import Checkpoint
from tests.integration.jobs import _restore_torch, log_event
from tests.integration.netns import netns_inode


def _obey_spawn_orders(config: dict, rank: int) -> None:
    orders = config["orders"]
    for name in os.listdir(orders):
        if not name.startswith("spawn-"):
            continue
        claim = os.path.join(orders, "spawned-" + name.removeprefix("spawn-"))
        try:
            with open(os.path.join(orders, name)) as f:
                if int(f.read().strip() or -1) != rank:
                    continue
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except (FileExistsError, FileNotFoundError, ValueError):
            continue
        # A grandchild in a session of its own: what a data loader's daemon or a stray `nohup` does.
        out = subprocess.run([sys.executable, "-c",
                              "import os,subprocess,sys;"
                              "p=subprocess.Popen(['sleep','3600'],start_new_session=True,stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL);print(p.pid)"],
                             capture_output=True, text=True, timeout=30)
        pid = int(out.stdout.strip())
        os.write(fd, str(pid).encode())
        os.close(fd)
        log_event(config, event="spawned", pid_spawned=pid, order=name)


def chaos_loop(config: dict) -> None:
    import torch

    from outlast.train.torch import prepare_model

    ctx = train.get_context()
    rank = ctx.get_world_rank()
    log_event(config, event="where", netns=netns_inode())
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    start = _restore_torch(train.get_checkpoint(), model, opt, "state.pt")
    log_event(config, event="start", restored_step=start - 1 if start else None)
    noticed = False
    pace_file = os.path.join(config["orders"], "pace")
    for step in range(start, config["steps"]):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(16, 8, generator=g)
        loss = ((model(x) - torch.sin(x.sum(dim=1, keepdim=True))) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        info = train.get_preemption_info()
        notice = info is not None and not noticed
        noticed = noticed or notice
        checkpoint = None
        if rank == 0 and ((step + 1) % config["every"] == 0 or notice):
            d = tempfile.mkdtemp()
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                       os.path.join(d, "state.pt"))
            checkpoint = Checkpoint.from_directory(d)
        if notice:
            log_event(config, event="notice", step=step, node_ids=list(info.node_ids))
        # The notice's checkpoint SYNC, as docs/guide/preemption.md says to lose no step: its ranks wait in
        # report() until the restart stops them. The others upload in the background as configured.
        mode = "SYNC" if notice else config.get("upload_mode", "SYNC")
        train.report({"step": step}, checkpoint=checkpoint, checkpoint_upload_mode=mode)
        log_event(config, event="step", step=step, saved=checkpoint is not None)
        _obey_spawn_orders(config, rank)
        try:
            with open(pace_file) as f:
                time.sleep(float(f.read().strip() or 0))
        except (FileNotFoundError, ValueError):
            pass
    if rank == 0:
        digest = hashlib.sha256()
        for name, tensor in sorted(model.module.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().numpy().tobytes())
        log_event(config, event="weights", digest=digest.hexdigest())
