"""What the standbys cost in memory: a node's standby fork server, its fork server's spares, and a
driver's standby agent.

    .venv/bin/python -m bench.standby_memory [--out FILE]

Starts one node (LocalCluster, the default preload: torch), waits until its standby fork server is
ready, and reads the PSS, USS and RSS of the agent, its fork server and the standby
(/proc/PID/smaps_rollup through psutil). Then starts a standby agent as a driver does for its
embedded node (`launch_agent(standby=True)`), waits until its fork server has imported, and reads
the same of the standby agent and its fork server. Between the two, a run of 2 ranks on the node
leaves its fork server with 2 spares (children forked ahead of a restart's ranks): their memory
is read too. PSS splits shared pages (torch's libraries)
between the processes that map them; USS is what ending the process gives back.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import psutil

from outlast.client.discovery import launch_agent
from outlast.client.preload import default_preload
from outlast.protocol import messages as m
from outlast.testing import LocalCluster
from outlast.train import RunConfig, ScalingConfig, Trainer

from bench.lib.harness import publish, wait_for


def one_report(config):
    from outlast import train
    train.report({"rank": train.get_context().get_world_rank()})


def mem(pid):
    info = psutil.Process(pid).memory_full_info()
    return {"pss_mib": round(info.pss / 2**20, 1), "uss_mib": round(info.uss / 2**20, 1),
            "rss_mib": round(info.rss / 2**20, 1)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    a = p.parse_args()
    out = {"benchmark": "standby_memory", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "preload": default_preload(), "load1": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="outlast-standby-mem-") as tmp:
        os.environ["OUTLAST_HOME"] = os.path.join(tmp, "home")
        trace = os.path.join(tmp, "trace.jsonl")
        os.environ["OUTLAST_TRACE_FILE"] = trace
        with LocalCluster(num_nodes=1) as cluster:
            cluster.wait_ready()

            def status():
                return cluster._request(cluster.head_address, m.StatusRequest())

            wait_for(lambda: status().fork_server_standby_pid, 600, "a ready standby fork server", poll_s=0.2)
            s = status()
            out["node"] = {"agent": mem(cluster.nodes["node-0"].proc.pid), "fork_server": mem(s.fork_server_pid),
                           "standby_fork_server": mem(s.fork_server_standby_pid)}
            Trainer(one_report, scaling_config=ScalingConfig(num_workers=2),
                    run_config=RunConfig(name="spares", storage_path=os.path.join(tmp, "storage"))).fit()

            def spares():
                with open(trace) as f:
                    pids = [e["child"] for e in map(json.loads, f) if e["phase"] == "zygote.spare"]
                return pids if len(pids) >= 2 else None

            time.sleep(1)  # the spares touch what they touch as they start
            out["node"]["spares"] = [mem(pid) for pid in wait_for(spares, 120, "the fork server's two spares",
                                                                  poll_s=0.2)]
            standby = launch_agent(cluster.preload, embedded=False, standby=True,
                                   extra_args=["--die-with-parent", "--cluster-key", str(cluster.key_file)])
            try:
                def its_server():
                    for pr in psutil.Process(standby.proc.pid).children():
                        with open(trace) as f:
                            if any(json.loads(line).get("pid") == pr.pid and '"zygote.ready"' in line for line in f):
                                return pr.pid
                    return None

                server = wait_for(its_server, 600, "the standby agent's fork server", poll_s=0.2)
                out["standby_agent"] = {"agent": mem(standby.proc.pid), "fork_server": mem(server)}
            finally:
                standby.close_go()
                os.close(standby.ready_fd)
                standby.proc.wait(timeout=30)
    node, agent = out["node"], out["standby_agent"]
    out["cost_mib"] = {
        "standby_fork_server_pss": node["standby_fork_server"]["pss_mib"],
        "standby_fork_server_uss": node["standby_fork_server"]["uss_mib"],
        "spares_pss": round(sum(sp["pss_mib"] for sp in node["spares"]), 1),
        "spares_uss": round(sum(sp["uss_mib"] for sp in node["spares"]), 1),
        "standby_agent_pss": round(agent["agent"]["pss_mib"] + agent["fork_server"]["pss_mib"], 1),
        "standby_agent_uss": round(agent["agent"]["uss_mib"] + agent["fork_server"]["uss_mib"], 1),
    }
    publish(out, a.out)


if __name__ == "__main__":
    sys.exit(main())
