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

import os
import subprocess
import sys
import time

from outlast import train
from tests.integration.jobs import deterministic_model, deterministic_step, log_event, torch_checkpoint, weights_digest
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
    ctx = train.get_context()
    rank = ctx.get_world_rank()
    log_event(config, event="where", netns=netns_inode())
    model, opt, start = deterministic_model(train.get_checkpoint())
    log_event(config, event="start", restored_step=start - 1 if start else None)
    noticed = False
    pace_file = os.path.join(config["orders"], "pace")
    for step in range(start, config["steps"]):
        deterministic_step(model, opt, step, rank)
        info = train.get_preemption_info()
        notice = info is not None and not noticed
        noticed = noticed or notice
        checkpoint = None
        if rank == 0 and ((step + 1) % config["every"] == 0 or notice):
            checkpoint = torch_checkpoint(model, opt, step)
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
        log_event(config, event="weights", digest=weights_digest(model))
