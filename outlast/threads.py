"""How many threads a workload's math libraries run: its share of its node's CPUs.

Left alone, every rank's torch (OpenMP, MKL) runs a thread per core of the node. Two ranks on two
cores then run four busy threads, and a collective waits on a peer whose threads are not running:
Ray's Transformers example, two ranks on two cores, ran 6.5 times slower than with one thread each.
Ray sets `OMP_NUM_THREADS` to each worker's CPUs; outlast gives each workload its CPU request, or,
without one, the node's CPUs split between the run's ranks there. A setting of the user's own wins:
`OMP_NUM_THREADS` in the node's environment or in `RunConfig(worker_runtime_env=...)`.

The fork server imports torch before any workload exists, and OpenMP reads its variable when it is
loaded, so the variable alone would change nothing in a forked child: `follow_cpu_share` tells the
libraries already loaded in the child as well.

The bottom layer (docs/architecture.md): it imports nothing of outlast.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import MutableMapping

THREADS_VAR = "OMP_NUM_THREADS"


def cpu_share_threads(requested_cpus: float | None, node_cpus: float, ranks_here: int) -> int:
    """The threads of one workload: its requested CPUs, else the node's split between `ranks_here`
    (the run's ranks on this node); whole threads, at least one."""
    share = requested_cpus if requested_cpus else node_cpus / max(1, ranks_here)
    return max(1, math.floor(share)) if math.isfinite(share) else 1


def follow_cpu_share(threads: int, environ: MutableMapping[str, str] = os.environ) -> int | None:
    """In a freshly forked workload, before user code: run `threads` threads unless the environment
    already says how many. Returns the count set, or None when nothing was (0: no share was given)."""
    own = environ.get(THREADS_VAR, "").strip()
    if own.isdigit() and int(own) > 0:
        count = int(own)  # the user's: still told to the libraries the fork server loaded before it
    elif threads > 0:
        count = threads
        environ[THREADS_VAR] = str(count)  # for what the workload starts or loads later
    else:
        return None
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(count)
        try:
            torch.set_num_interop_threads(count)
        except RuntimeError:
            pass  # the pool is fixed once started, and the fork server starts none; a user's own use is theirs
    return count
