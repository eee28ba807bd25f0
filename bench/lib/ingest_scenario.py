"""One ingest run, on Ray or on outlast under the same names: a TorchTrainer of 2 workers whose loop reads
its shard of a dataset (`read_parquet` or `read_images`) through `get_dataset_shard("train").iter_torch_batches`,
one epoch, and appends each rank's rows and times to the events file.

    python -m bench.lib.ingest_scenario --framework ray|outlast --kind parquet|images --data DIR \
        --events FILE --storage DIR [--batch-size 1024] [--ray-cpus 4]

The workers import this module too: nothing but the standard library at import time.
"""

from __future__ import annotations

import argparse
import importlib
import time

from bench.lib.events import emit


def ingest_loop(config: dict) -> None:
    train = importlib.import_module(f"{config['framework']}.train")
    shard = train.get_dataset_shard("train")
    rank = train.get_context().get_world_rank()
    rows, batches, first, started = 0, 0, None, time.time()
    for batch in shard.iter_torch_batches(batch_size=config["batch_size"]):
        rows += len(next(iter(batch.values())))
        batches += 1
        if first is None:
            first = time.time()
    emit(config["events"], rank=rank, rows=rows, batches=batches, start=started, first=first, end=time.time())
    train.report({"rows": rows})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=("ray", "outlast"), required=True)
    p.add_argument("--kind", choices=("parquet", "images"), required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ray-cpus", type=int, default=4,
                   help="Ray's logical CPUs: one per train worker, the rest for Ray Data's read tasks")
    args = p.parse_args()
    fw = args.framework
    if fw == "ray":
        import ray

        ray.init(num_cpus=args.ray_cpus, include_dashboard=False)
    data = importlib.import_module(f"{fw}.data")
    train = importlib.import_module(f"{fw}.train")
    torch_side = importlib.import_module(f"{fw}.train.torch")
    ds = data.read_parquet(args.data) if args.kind == "parquet" else data.read_images(args.data, mode="RGB")
    trainer = torch_side.TorchTrainer(
        ingest_loop, datasets={"train": ds},
        train_loop_config={"framework": fw, "events": args.events, "batch_size": args.batch_size},
        scaling_config=train.ScalingConfig(num_workers=args.workers),
        run_config=train.RunConfig(name=f"ingest-{args.kind}", storage_path=args.storage))
    trainer.fit()


if __name__ == "__main__":
    main()
