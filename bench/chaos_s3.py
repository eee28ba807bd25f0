"""The chaos harness's S3 server, a process of its own that the harness kills and starts again.

    python -m bench.chaos_s3 HOST PORT DIR [--standby]

moto serves the S3 protocol and keeps its buckets in memory, so it keeps them across a kill
with its recorder: every request it takes is appended to `DIR/requests.jsonl` before it is
carried out (`MOTO_ENABLE_RECORDING`), and a server started again on the same `DIR` replays
them into its fresh backend before it listens, in-process, then writes the log again as one
PUT per object it holds, so that a restart costs what is stored, not every request ever made.
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
from urllib.parse import quote


# moto takes the service from the credential scope; it checks no signature.
SIGNED = {"Authorization": "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, "
                           "SignedHeaders=host, Signature=0"}


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


def _replay(app, log: Path, host: str) -> int:
    """Apply the logged requests in order; returns how many."""
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
        headers = {k: v for k, v in entry["headers"].items() if k.lower() != "transfer-encoding"}
        client.open(entry["url"], method=entry["method"], headers=headers, data=body).close()
        n += 1
    return n


def _compact(log: Path, host: str) -> int:
    """Write the log again as what the backend holds now: each bucket, then each object."""
    from moto.s3.models import s3_backends

    entries = []
    for account in s3_backends.values():
        for backend in account.values():
            for name, bucket in backend.buckets.items():
                entries.append({"method": "PUT", "url": f"http://{host}/{name}", "headers": {"Host": host, **SIGNED},
                                "body": "", "body_encoded": False})
                for key in bucket.keys.values():
                    value = key.value
                    entries.append({"method": "PUT", "url": f"http://{host}/{name}/{quote(key.name)}",
                                    "headers": {"Host": host, "Content-Length": str(len(value)), **SIGNED},
                                    "body": base64.b64encode(value).decode(), "body_encoded": True})
    tmp = log.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in entries))
    os.replace(tmp, log)
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
    if log.exists():
        recorder.stop_recording()
        replayed = _replay(app, log, f"{host}:{port}")
        kept = _compact(log, f"{host}:{port}")
        print(f"replayed {replayed} requests; {kept} kept", flush=True)
    recorder.start_recording()
    server = make_server(host, port, _delaying(app, d / "delay"), threaded=True, request_handler=MotoRequestHandler)
    (d / "ready").write_text(str(os.getpid()))
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], "--standby" in sys.argv[4:])
