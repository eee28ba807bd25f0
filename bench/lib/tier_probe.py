"""One restore as a worker makes it, timed in a fresh process (outlast's venv):

    python -m bench.lib.tier_probe --dest ROOT/RUN/NAME --node NODE --tier-dir DIR

restores checkpoint NAME of the run at ROOT/RUN on node NODE, whose memory tier lies under DIR:
from that node's memory when every file has a whole copy there, else from storage, each file
checked against the manifest. Prints {"s": seconds, "source": where it came from}.
"""
import argparse
import json
import time
from pathlib import Path

from outlast.storage import open_storage
from outlast.storage.tier_restore import restore


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dest", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--tier-dir", required=True)
    p.add_argument("--cache", required=True)
    args = p.parse_args()
    root, _, name = args.dest.rstrip("/").rpartition("/")
    top, _, run = root.rpartition("/")
    storage = open_storage(top)
    t0 = time.perf_counter()
    _path, source, _said = restore(storage, run, name, Path(args.cache), args.node, Path(args.tier_dir))
    print(json.dumps({"s": time.perf_counter() - t0, "source": source.value}))


if __name__ == "__main__":
    main()
