"""A loop that prints, run unchanged on Ray Train V2 or on outlast: its step time with and
without 10,000 lines per second per rank going to the driver.

    python -m bench.lib.output_scenario --framework ray|outlast --lines-per-step 0|100 --events FILE

Each step spins for STEP_S (stand-in for compute) and prints `--lines-per-step` lines; rank 0
appends its step times to --events. The driver's stdout carries the ranks' lines (counted by
bench/worker_output.py).
"""
import argparse
import json
import os
import time

from bench.lib.train_api import load_api

STEP_S = 0.01
STEPS = 300


def make_loop(framework):
    def train_loop(config):
        import json as j
        import time as t

        if config["framework"] == "ray":
            from ray import train as tr
        else:
            from outlast import train as tr
        rank = tr.get_context().get_world_rank()
        times = []
        for step in range(config["steps"]):
            begin = t.perf_counter()
            while t.perf_counter() - begin < config["step_s"]:
                pass
            for i in range(config["lines"]):
                print(f"rank {rank} step {step} line {i}")
            times.append(t.perf_counter() - begin)
        if rank == 0:
            with open(config["events"], "a") as f:
                f.write(j.dumps({"step_times": times}) + "\n")

    return train_loop


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=["ray", "outlast"], required=True)
    p.add_argument("--lines-per-step", type=int, default=0)
    p.add_argument("--events", required=True)
    p.add_argument("--storage", default=None)
    args = p.parse_args()
    api = load_api(args.framework)
    api.TorchTrainer(make_loop(args.framework),
                     train_loop_config={"framework": args.framework, "steps": STEPS, "step_s": STEP_S,
                                        "lines": args.lines_per_step, "events": os.path.abspath(args.events)},
                     scaling_config=api.ScalingConfig(num_workers=2),
                     run_config=api.RunConfig(name=f"output_{int(time.time() * 1000)}",
                                              storage_path=args.storage)).fit()
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()
