"""Where the dashboard's facts come from: the runs' storage and, when one is reachable, a node.

Every read goes through the readers `outlast runs` and `outlast status` use (RunStore, the
agent's client), each under a deadline: a store or a node that does not answer becomes a page
that says so, never a request that hangs.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Callable, TypeVar

import msgspec
import zmq

from outlast.cli.confined import Refused, relative_parts
from outlast.cli.dashboard.bounded import BoundedStorage
from outlast.cli.dashboard import views
from outlast.cli.runs import summaries
from outlast.cli.worker_logs import find_output, from_its_node, local_log_dir, read_here
from outlast.client.discovery import AgentUnavailable, find_running_agent, request
from outlast.protocol import messages as m
from outlast.storage import open_storage
from outlast.storage.base import Storage
from outlast.storage.records import RUN_STATE_NAME, CorruptDocument, NewerVersionError, RunState
from outlast.storage.restore import CorruptCheckpointError, verify
from outlast.storage.run_store import RunStore

T = TypeVar("T")
SETTLED_S = 30.0  # an attempt ended this long ago has had every report written (report_log.FLUSH_S: 1 s)

# Threads of their own: a store that hangs holds one until it answers, never the server.
_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="outlast-dashboard")


class Unavailable(Exception):
    """What a page says instead of its content: the message names what is wrong and what to do."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


def within(timeout_s: float, what: str, fn: Callable[..., T], *args: Any) -> T:
    job = _pool.submit(fn, *args)
    try:
        return job.result(timeout=timeout_s)
    except FutureTimeout:
        raise Unavailable(f"{what} did not answer within {timeout_s:g} s; check that it is reachable from "
                          "this machine (its address, credentials and network), or start the dashboard with "
                          "a longer --timeout") from None


class Sources:
    def __init__(self, storage_paths: list[str], timeout_s: float = 10.0) -> None:
        self.paths = storage_paths
        self.timeout_s = timeout_s
        self.log_dir = local_log_dir()
        self._storages: dict[int, Storage] = {}
        self._kept: dict[tuple, list] = {}  # (storage, run, its creation, attempt) -> its reports, once it has ended

    def storage(self, i: int) -> Storage:
        if not 0 <= i < len(self.paths):
            raise Unavailable(f"there is no storage path number {i}; the dashboard was started with "
                              f"{len(self.paths)}", status=404)
        if i not in self._storages:
            path = self.paths[i]
            try:
                storage = open_storage(path)
            except (ValueError, ImportError) as e:
                raise Unavailable(f"cannot open storage path {path}: {e}", status=400) from None
            local = storage.local_path("")
            if local is not None and not local.is_dir():
                raise Unavailable(f"storage path {path} does not exist on this machine (looked for {local}); "
                                  "give the directory the runs were written to (RunConfig(storage_path=...))",
                                  status=404)
            self._storages[i] = BoundedStorage(storage)  # type: ignore[assignment]
        return self._storages[i]

    # ---- runs ---------------------------------------------------------------------

    def runs(self, i: int) -> list[dict[str, Any]]:
        storage = self.storage(i)
        found = within(self.timeout_s, f"the store at {storage.uri('')}", _guarded, summaries, storage)
        return [msgspec.to_builtins(s) for s in found]

    def _store(self, i: int, name: str) -> RunStore:
        if not name or len(name.encode("utf-8", "replace")) > 255 or "/" in name or "\x00" in name \
                or name in (".", ".."):
            raise Unavailable(f"{name[:300]!r} is not a run's name: a run is a directory directly under its "
                              "storage path (see /runs)", status=404)
        storage = self.storage(i)
        names = within(self.timeout_s, f"the store at {storage.uri('')}", _guarded, storage.list_dirs, "")
        # A run is named by its directory as listed, never by a path made of the request: nothing
        # outside the run directories can be reached through a name.
        if name not in names or not within(self.timeout_s, f"the store at {storage.uri('')}", _guarded,
                                           storage.exists, f"{name}/{RUN_STATE_NAME}"):
            raise Unavailable(f"there is no run named {name!r} under {storage.uri('')}", status=404)
        return RunStore(storage, name)

    def _state(self, storage: Storage, name: str) -> RunState:
        store = RunStore(storage, name)
        state = within(self.timeout_s, f"the store at {storage.uri('')}", _guarded, store.load_state)
        if state is None:
            raise Unavailable(f"no run at {storage.uri(name)}", status=404)
        return state

    def run(self, i: int, name: str) -> dict[str, Any]:
        store = self._store(i, name)
        where = store.storage.uri(store.run_dir)
        state = self._state(store.storage, name)
        now = time.time()
        reports = {a.attempt: self._kept[(i, name, state.created_at, a.attempt)] for a in state.attempts
                   if (i, name, state.created_at, a.attempt) in self._kept}
        jobs = {a.attempt: _pool.submit(_guarded, store.read_reports, a.attempt) for a in state.attempts
                if a.attempt not in reports}
        deadline = time.monotonic() + self.timeout_s
        for attempt, job in jobs.items():
            try:
                reports[attempt] = job.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise Unavailable(f"the store at {where} did not send the reports within {self.timeout_s:g} s; "
                                  "check that it is reachable, or start the dashboard with a longer --timeout") from None
        for a in state.attempts:
            # An attempt that ended a while ago gets no more reports (its driver writes them within a
            # second or two): kept here, a page that refreshes reads only the attempts still going.
            if a.ended_at is not None and now - a.ended_at > SETTLED_S:
                self._kept[(i, name, state.created_at, a.attempt)] = reports[a.attempt]
        return views.run_view(state, where, dict(sorted(reports.items())), now)

    def checkpoint(self, i: int, name: str, checkpoint_dir: str, check: bool) -> dict[str, Any]:
        store = self._store(i, name)
        state = self._state(store.storage, name)
        if checkpoint_dir not in {c.checkpoint_dir for c in state.checkpoints}:
            raise Unavailable(f"run {name} has no committed checkpoint named {checkpoint_dir!r}", status=404)
        manifest = within(self.timeout_s, f"the store at {store.storage.uri('')}", _guarded,
                          store.read_manifest, checkpoint_dir)
        if manifest is None:
            raise Unavailable(f"the manifest of {checkpoint_dir} is gone from {store.storage.uri(name)}", status=404)
        out = views.checkpoint_view(manifest)
        if check:
            # A check reads every byte: it gets as long as a transfer of the checkpoint may take.
            out["check"] = within(max(self.timeout_s, 600.0), f"the check of {checkpoint_dir}", _check, store,
                                  manifest)
        return out

    def logs(self, i: int, name: str, rank: int, attempt: int | None, lines: int) -> dict[str, Any]:
        store = self._store(i, name)
        state = self._state(store.storage, name)
        found = find_output(state, rank, attempt)
        if found is None:
            raise Unavailable(f"the history of run {name} names no output file of rank {rank} in "
                              f"{'attempt %d' % attempt if attempt is not None else 'any attempt'}", status=404)
        number, out = found
        # The history is data: only a file of the shape outlast writes, under this machine's log
        # directory (or its node's, which its agent reads), without following a link.
        try:
            text = read_here(state.name, number, out, lines, self.log_dir)
        except Refused as e:
            raise Unavailable(str(e), status=422) from None
        except OSError as e:
            raise Unavailable(f"rank {rank}'s output of attempt {number} at {out.path} could not be read here: "
                              f"{e.strerror or e}") from None
        if text is None:
            try:
                text = within(self.timeout_s + 5, f"node {out.node_id}", from_its_node, out, lines)
            except AgentUnavailable as why:
                raise Unavailable(f"rank {rank}'s output of attempt {number} is kept on node {out.node_id} at "
                                  f"{out.path}, which is not on this machine nor could be asked of its node "
                                  f"({why})") from None
        return {"rank": rank, "attempt": number, "node_id": out.node_id, "path": out.path, "lines": text}

    # ---- the cluster --------------------------------------------------------------

    def cluster(self) -> dict[str, Any]:
        return within(self.timeout_s + 5, "the node agent on this machine", _cluster, self.timeout_s)


def _guarded(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except (CorruptDocument, NewerVersionError) as e:
        raise Unavailable(str(e), status=422) from None
    except FileNotFoundError as e:
        raise Unavailable(f"not found on storage: {e}", status=404) from None
    except PermissionError as e:
        raise Unavailable(f"storage refused the read ({e}); check this machine's credentials", status=403) from None
    except OSError as e:
        raise Unavailable(f"storage could not be read: {e}") from None


def _check(store: RunStore, manifest) -> dict[str, Any]:
    for entry in manifest.files:  # the manifest is data: it names files inside its checkpoint, or none
        try:
            relative_parts(entry.path)
        except Refused as e:
            return {"ok": False, "detail": f"its manifest names a file outside the checkpoint: {e}; nothing was read"}
    local = store.storage.local_path(store.path(manifest.checkpoint_dir))
    tmp = None
    digests: dict[str, str] = {}
    try:
        if local is None:
            tmp = Path(tempfile.mkdtemp(prefix="outlast-dashboard-check-"))
            digests = store.storage.download_dir(store.path(manifest.checkpoint_dir), tmp / "c")
            local = tmp / "c"
        verify(local, manifest, digests)
        return {"ok": True, "detail": f"every one of its {len(manifest.files)} file(s) matches its checksum"}
    except CorruptCheckpointError as e:
        return {"ok": False, "detail": str(e)}
    except OSError as e:
        return {"ok": False, "detail": f"its files could not be read: {e}"}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _cluster(timeout_s: float) -> dict[str, Any]:
    ctx = zmq.Context()
    try:
        try:
            here = find_running_agent(ctx, answer_within_s=timeout_s)  # a page never waits longer than asked
            if here is None:
                raise Unavailable("no outlast node runs on this machine (start one with `outlast start`, or set "
                                  "$OUTLAST_ADDRESS to a node's address); the runs' pages work from storage alone")
            reply = request(ctx, here, m.StatusRequest(), timeout_s=timeout_s)
            head = reply.head_address or here if isinstance(reply, m.StatusReply) else here
            table = reply if isinstance(reply, m.StatusReply) and reply.nodes and not reply.head_address \
                else request(ctx, head, m.ListNodes(), timeout_s=timeout_s)
        except AgentUnavailable as e:
            raise Unavailable(str(e)) from None
        nodes = table.nodes if isinstance(table, (m.NodeList, m.StatusReply)) else []
        statuses: dict[str, m.StatusReply | str] = {}
        for n in nodes:
            if n.state == "dead":
                continue
            try:
                got = reply if isinstance(reply, m.StatusReply) and n.node_id == reply.node_id else \
                    request(ctx, n.address, m.StatusRequest(), timeout_s=min(timeout_s, 2.0))
                statuses[n.node_id] = got if isinstance(got, m.StatusReply) else "it sent no status"
            except AgentUnavailable as e:
                statuses[n.node_id] = str(e)
        return views.cluster_view(nodes, statuses, time.time(), here)
    finally:
        ctx.destroy(linger=0)
