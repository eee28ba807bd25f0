"""What every benchmark here shares: repeated figures as median and range, the machine and its load
beside them, the JSON document, waiting, and the servers and state directories a run needs.
Standard library only: Ray's side, which has no psutil, sums its figures here too (finding the
processes a benchmark started is bench/lib/proctree.py's)."""
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench.lib import venvs


def summary(values):
    """Median and range of repeated measurements; None when none succeeded."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def summarize_runs(runs):
    """A list of {figure: value} dicts (one per repeat) as {figure: summary}."""
    keys = sorted({k for r in runs for k in r})
    return {k: summary([r.get(k) for r in runs]) for k in keys}


def median_of(fig):
    return fig["median"] if isinstance(fig, dict) else fig


def ratio(num, den):
    num, den = median_of(num), median_of(den)
    if num is None or den is None or den <= 0 or num < 0:
        return None
    return num / den


def load():
    """The load average (1, 5, 15 min) now: other work on a shared machine moves every figure."""
    return [round(x, 2) for x in os.getloadavg()]


def machine(versions):
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # the kernel's MemTotal
    return {"nproc": os.cpu_count(), "mem_gib": round(mem / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "versions": versions}


def interleaved(names, repeat):
    """(repeat index, name) pairs alternating the order each round, so that neither side
    always runs first (the page cache, a neighbour's burst of work)."""
    for i in range(repeat):
        for name in (names if i % 2 == 0 else list(reversed(names))):
            yield i, name


def write_json(doc, path):
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")


def publish(doc, path):
    """The benchmark's one JSON document: on stdout, and in `path` when given."""
    print(json.dumps(doc, indent=1))
    write_json(doc, path)


def stamp():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def wait_for(pred, timeout_s, what, poll_s=0.05, tick=None):
    """pred()'s first truthy value, asked every `poll_s` (after `tick()`, when given); TimeoutError
    naming `what` once `timeout_s` have passed."""
    end = time.time() + timeout_s
    while time.time() < end:
        if tick:
            tick()
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def run_json(cmd, timeout):
    """Runs a scenario that prints one JSON document (progress on stderr, passed through) from the
    repository root: its document, or {"error": ...} when it timed out or printed none."""
    print(f"[bench] {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, timeout=timeout, text=True, cwd=venvs.ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    document = last_document(done.stdout)
    if document is None:
        return {"error": f"no JSON (exit {done.returncode})", "stdout_tail": done.stdout[-2000:]}
    return document


def last_document(text: str):
    """The JSON document that ends `text`: a scenario prints it last, and the lines before it may be its workers'
    output, which the driver prints as they come. None when `text` ends in none."""
    start = len(text)
    while (start := text.rfind("{", 0, start)) >= 0:
        if start == 0 or text[start - 1] == "\n":
            try:
                return json.loads(text[start:])
            except ValueError:
                pass
    return None


def prepare_both(only, prefix):
    """What a benchmark of both frameworks does first: the frameworks it runs (`only`, or outlast and
    Ray), Ray's virtual environment made if Ray is among them and it is missing, a SIGTERM turned into
    an exit (143) so that cleanups run, and a work directory of its own whose private state directories
    this process now carries (private_state_dirs): (frameworks, work directory)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    frameworks = [only] if only else ["outlast", "ray"]
    if "ray" in frameworks:
        venvs.ensure_ray_venv()
    workdir = tempfile.mkdtemp(prefix=prefix)
    private_state_dirs(workdir)
    return frameworks, workdir


def private_state_dirs(workdir):
    """Gives this process, and so whatever it starts, state directories of its own under `workdir`
    (OUTLAST_HOME, RAY_TMPDIR): the benchmark's nodes are found by nothing else on the machine, its runs
    join nobody else's, and the processes that carry them are the ones it stops (proctree.ours)."""
    os.environ["OUTLAST_HOME"] = os.path.join(workdir, "outlast-home")
    os.environ["RAY_TMPDIR"] = os.path.join(workdir, "r")  # short: Ray's socket paths must fit 107 bytes
    os.makedirs(os.environ["RAY_TMPDIR"])


def start_s3(workdir, python, bucket="bench"):
    """A moto server (start_moto) holding an empty `bucket`: (process, the AWS_* variables that reach it)."""
    proc, url = start_moto(workdir, python)
    aws = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        subprocess.run([python, "-c", f"import boto3; boto3.client('s3').create_bucket(Bucket={bucket!r})"],
                       env={**os.environ, **aws}, check=True, timeout=60)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, aws


def start_moto(workdir, python):
    """A moto S3 server on a free loopback port: (process, endpoint URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    moto = os.path.join(os.path.dirname(python), "moto_server")
    with open(os.path.join(workdir, "moto.log"), "w") as out:
        proc = subprocess.Popen([moto, "-p", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        if proc.poll() is not None:
            break  # e.g. the port was taken meanwhile: never talk to someone else's server
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto_server did not come up, see {workdir}/moto.log")


def start_seaweedfs(workdir, weed, bucket="bench"):
    """A SeaweedFS server (`weed mini`: master, volume, filer and S3 gateway in one process) on free loopback
    ports, its data under workdir, holding an empty `bucket`: (process, the AWS_* variables that reach it).
    Unlike moto, which reads a whole object to serve each ranged GET, it reads the chunks a range covers,
    so a client's part size costs the server no extra bytes. It is run with credentials (a server with
    none refuses some signed calls, pyarrow's multipart parts among them)."""
    ports = {}
    socks = []
    for flag in ("s3.port", "master.port", "volume.port", "filer.port", "admin.port"):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports[flag] = s.getsockname()[1]
    for s in socks:
        s.close()
    # The gRPC ports are each HTTP port + 10000: the free ports are taken below 55000.
    taken = [p for p in ports.values() if p > 55000]
    if taken:
        return start_seaweedfs(workdir, weed, bucket)
    aws = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{ports['s3.port']}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    data = os.path.join(workdir, "seaweedfs")
    os.makedirs(data, exist_ok=True)
    cmd = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={bucket}",
           "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
           *(f"-{flag}={port}" for flag, port in ports.items())]
    with open(os.path.join(workdir, "seaweedfs.log"), "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **aws}, cwd=data)
    try:
        import boto3  # the orchestrating process is outlast's Python, which has it

        client = boto3.client("s3", endpoint_url=aws["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")

        def ready():
            if proc.poll() is not None:
                raise RuntimeError(f"weed mini exited ({proc.returncode}), see {workdir}/seaweedfs.log")
            try:
                client.head_bucket(Bucket=bucket)
                return True
            except Exception:
                return False

        wait_for(ready, 120, "SeaweedFS's S3 gateway", poll_s=0.5)
    except BaseException:
        stop_seaweedfs(proc)
        raise
    return proc, aws


def stop_seaweedfs(proc):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
