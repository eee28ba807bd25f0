"""The chaos harness's S3 server, a process of its own that the harness kills and starts again.

    python -m bench.lib.chaos_s3 HOST PORT DIR [--standby]

moto serves the S3 protocol and keeps its buckets in memory, so it keeps them across a kill
with its recorder: every request it takes is appended to `DIR/requests.jsonl` before it is
carried out. A server started again on the same `DIR` puts the objects of `DIR/snapshot.jsonl`
back into its fresh backend, replays the logged requests on top of them (in-process, through
moto's WSGI app), then writes a new snapshot of what it holds and empties the log before it
listens: a restart costs what is stored plus the requests since the last one.
A request cut off by the kill may have been logged and not answered: it is applied on restart,
as a real store may apply a write whose reply was lost.

Each request waits first for the seconds in `DIR/delay` (absent: none), so that the harness
can slow storage down past a timeout. The server writes `DIR/ready` once it listens. With
`--standby` it imports moto, then waits for a line on its standard input before it replays.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
import time
from pathlib import Path


def _delaying(app, delay_file: Path):
    def wrapped(environ, start_response):
        try:
            delay = float(delay_file.read_text() or 0)
        except (FileNotFoundError, ValueError):
            delay = 0.0
        if delay > 0:
            time.sleep(delay)
        return app(environ, start_response)

    return wrapped


def _replay(app, log: Path) -> int:
    """Apply the logged requests that change something, in order; returns how many."""
    from werkzeug.test import Client

    client = Client(app)
    n = 0
    for line in log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line the kill cut short: its request was never carried out
        body = entry.get("body") or b""
        if entry.get("body_encoded"):
            body = base64.b64decode(body)
        if entry["method"] in ("GET", "HEAD"):
            continue  # changed nothing
        headers = {k: v for k, v in entry["headers"].items() if k.lower() != "transfer-encoding"}
        client.open(entry["url"], method=entry["method"], headers=headers, data=body).close()
        n += 1
    return n


def _load(snapshot: Path) -> int:
    """Put back the objects of the last snapshot, straight into moto's backend."""
    from moto.s3.models import s3_backends

    n = 0
    for line in snapshot.read_text().splitlines():
        e = json.loads(line)
        backend = s3_backends[e["account"]][e["partition"]]
        if "key" not in e:
            backend.create_bucket(e["bucket"], e["region"])
            continue
        backend.put_object(e["bucket"], e["key"], base64.b64decode(e["value"]))
        n += 1
    return n


def _snapshot(snapshot: Path, log: Path) -> int:
    """Write what the backend holds now (each bucket, then each object), then empty the request log."""
    from moto.s3.models import s3_backends

    entries = []
    for account, partitions in s3_backends.items():
        for partition, backend in partitions.items():
            for name, bucket in backend.buckets.items():
                where = {"account": account, "partition": partition, "bucket": name}
                entries.append({**where, "region": bucket.region_name})
                entries += [{**where, "key": key.name, "value": base64.b64encode(key.value).decode()}
                            for key in bucket.keys.values()]
    tmp = snapshot.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in entries))
    os.replace(tmp, snapshot)
    log.write_text("")  # killed before this line, the next start replays the requests again: the same result
    return len(entries)


def main(host: str, port: int, directory: str, standby: bool) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    log = d / "requests.jsonl"
    os.environ["MOTO_RECORDER_FILEPATH"] = str(log)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    from moto.moto_api import recorder
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    if standby:
        # Imported and waiting: the outage lasts as long as the harness keeps the port closed, plus
        # the replay, not plus a Python start, which takes seconds on a loaded machine.
        sys.stdin.readline()
    (d / "ready").unlink(missing_ok=True)
    snapshot = d / "snapshot.jsonl"
    if log.exists() or snapshot.exists():
        recorder.stop_recording()
        t0 = time.monotonic()
        loaded = _load(snapshot) if snapshot.exists() else 0
        replayed = _replay(app, log) if log.exists() else 0
        _snapshot(snapshot, log)
        print(f"{loaded} objects loaded, {replayed} requests replayed in {time.monotonic() - t0:.1f} s", flush=True)
    recorder.start_recording()
    server = make_server(host, port, _delaying(app, d / "delay"), threaded=True, request_handler=MotoRequestHandler)
    (d / "ready").write_text(str(os.getpid()))
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], "--standby" in sys.argv[4:])
