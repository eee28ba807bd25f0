"""outlast's side of the scenarios that Ray runs on `ray.cluster_utils.Cluster`: a head that takes no
workers and worker nodes of a few CPUs, on loopback."""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def head_and_workers(work: str, workers: int = 2, cpus: int = 1, **cluster_args):
    """A `LocalCluster` under `work`/cluster of a head with no CPUs and `workers` nodes of `cpus` CPUs
    each, every fork server warm (torch imported), all ready: (cluster, the worker nodes' ids)."""
    from outlast.testing import LocalCluster
    from outlast.train.torch.backend import TorchBackend

    with LocalCluster(num_nodes=1, cpus_per_node=0, preload=list(TorchBackend.preload),
                      workdir=os.path.join(work, "cluster"), **cluster_args) as cluster:
        nodes = [cluster.add_node(extra_args=["--num-cpus", str(cpus)]) for _ in range(workers)]
        cluster.wait_ready()
        yield cluster, nodes
