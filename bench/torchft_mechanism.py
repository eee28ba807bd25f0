"""torchft 0.2.0 on CPU and gloo, for docs/guide/live-recovery.md: one of two replica groups is
SIGKILLed while training, and a replacement heals from the survivor.

    python -m venv /tmp/tft-venv && /tmp/tft-venv/bin/pip install torch==2.13.0 torchft==0.2.0
    /tmp/tft-venv/bin/python bench/torchft_mechanism.py [STATE_MB]

torchft is not a dependency of outlast: this runs in a virtual environment of its own. A
lighthouse runs in this process (heartbeat timeout 0.5 s, a tenth of its default), each replica
group is one process with its own store and manager, and the state is STATE_MB MB (default 100).
Prints one JSON object: seconds from the SIGKILL to the survivor's first step committed alone,
and from the replacement's Manager created to its first committed step (quorum, then the state
over torchft's HTTP transport).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta


def replica(lighthouse: str, rid: str, mb: int) -> None:
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    state = {"w": torch.zeros(mb * 262144), "step": 0}

    def load(sd: dict) -> None:
        state["w"].copy_(sd["w"])
        state["step"] = sd["step"]

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=load,
                      state_dict=lambda: {"w": state["w"], "step": state["step"]}, min_replica_size=1,
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=lighthouse, replica_id=rid, timeout=timedelta(seconds=10),
                      heartbeat_interval=timedelta(milliseconds=50))
    print(json.dumps({"rid": rid, "t": time.monotonic(), "ready": True}), flush=True)
    grad = torch.ones(1000)
    while True:
        manager.start_quorum()
        manager.allreduce(grad).wait()
        ok = manager.should_commit()
        print(json.dumps({"rid": rid, "t": time.monotonic(), "ok": ok}), flush=True)
        time.sleep(0.01)


def main(mb: int) -> None:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=10,
                                  heartbeat_timeout_ms=500)
    lines: list[dict] = []

    def start(rid: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, __file__, "replica", lighthouse.address(), rid, str(mb)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=lambda: lines.extend(json.loads(x) for x in p.stdout), daemon=True).start()
        return p

    a, b = start("a"), start("b")
    while sum(1 for x in lines if x["rid"] == "a" and x.get("ok")) < 20:
        time.sleep(0.05)
    t_kill = time.monotonic()
    os.kill(b.pid, signal.SIGKILL)
    b.wait()
    c = start("c")
    deadline = t_kill + 180
    while not any(x["rid"] == "c" and x.get("ok") for x in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = [x for x in lines if x["t"] > t_kill]
    ready = next((x["t"] for x in after if x["rid"] == "c" and x.get("ready")), None)
    first_c = next((x["t"] for x in after if x["rid"] == "c" and x.get("ok")), None)
    print(json.dumps({"state_mb": mb,
                      "kill_to_survivor_step_alone_s": next((x["t"] - t_kill for x in after
                                                             if x["rid"] == "a" and x.get("ok")), None),
                      "replacement_ready_to_first_commit_s": first_c - ready if first_c and ready else None}))
    for p in (a, c):
        p.kill()
        p.wait()
    lighthouse.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] == ["replica"]:
        replica(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
