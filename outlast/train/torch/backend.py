from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from datetime import timedelta

from outlast.protocol.transport import LIVE_STORE_VAR
from outlast.agent.gpus import own_device_indices
from outlast.client.preload import TORCH_MODULES
from outlast.errors import RendezvousError, WorkerSetupError
from outlast.faults import fault_point
from outlast.train.backend import Backend
from outlast.train.context import TrainContext
from outlast.train.gloo_bind import IFNAME_VAR, interface_toward


@dataclass
class TorchConfig:
    """`backend`: 'gloo' or 'nccl' (default: nccl with GPUs, gloo without). `init_method`: how the
    ranks meet, 'env' (MASTER_ADDR/MASTER_PORT) or 'tcp' (tcp://MASTER_ADDR:MASTER_PORT)."""

    backend: str | None = None
    init_method: str = "env"
    timeout_s: int = 1800

    def __post_init__(self) -> None:
        if self.init_method not in ("env", "tcp"):
            raise ValueError(f"TorchConfig.init_method must be 'env' or 'tcp', got {self.init_method!r}")


class TorchBackend(Backend):
    # DistributedDataParallel imports torch._dynamo (and sympy) on first use: seconds we pay once.
    preload = TORCH_MODULES
    needs_rendezvous = True

    def __init__(self, config: TorchConfig | None = None, use_gpu: bool = False) -> None:
        self.config = config or TorchConfig()
        self.use_gpu = use_gpu

    def on_start(self, context: TrainContext) -> None:
        import torch

        backend = self.config.backend or ("nccl" if self.use_gpu else "gloo")
        if self.use_gpu:
            if not torch.cuda.is_available():
                raise WorkerSetupError(f"ScalingConfig(use_gpu=True) but this worker on node "
                                       f"{os.environ.get('OUTLAST_NODE_ID', '?')} sees no CUDA device (torch "
                                       f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); install "
                                       "a CUDA build of torch there, or start the node without --num-gpus")
            torch.cuda.set_device(own_device_indices(os.environ, context.local_rank, torch.cuda.device_count())[0])
        if os.environ.get(LIVE_STORE_VAR):
            # Live recovery: the ranks reduce in a group of their own per generation (LiveTraining), which a
            # replacement joins; a default group would have to be formed again by every rank at each death.
            return
        timeout = timedelta(seconds=self.config.timeout_s)
        # Bind to the interface this node reaches rank 0's node through (outlast/train/gloo_bind.py): the default
        # group's gloo takes it only by name, from the environment.
        if IFNAME_VAR not in os.environ and (iface := interface_toward(os.environ.get("MASTER_ADDR"))):
            os.environ[IFNAME_VAR] = iface
        try:
            fault_point(f"rendezvous.rank{context.world_rank}")
            self._meet(backend, context, timeout)
        except Exception as e:
            raise RendezvousError(f"rank {context.world_rank} of attempt {context.attempt} could not meet the other "
                                  f"ranks in torch.distributed ({backend}): {type(e).__name__}: {e}") from e

    def _meet(self, backend: str, context: TrainContext, timeout: timedelta) -> None:
        import torch.distributed as dist

        if "MASTER_PORT" in os.environ:  # the user's own rendezvous
            init = "env://" if self.config.init_method == "env" else \
                f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            dist.init_process_group(backend=backend, init_method=init, rank=context.world_rank,
                                    world_size=context.world_size, timeout=timeout)
            return
        # Rank 0's store listens on a port of its choosing before any rank learns the port, which every rank
        # hears from rank 0. A rank that reached for the store before it listened would wait out torch's
        # connect backoff, and a port found free, closed and bound again later could be someone else's by then.
        #
        # Every key goes under a name rank 0 draws for this attempt. A store port is the kernel's choice and
        # comes round again: a rank of an earlier attempt or of another run that still retries its own store's
        # port (torch retries for the whole timeout) may reach this store, and under torch's fixed key names
        # its gloo address would stand for one of ours, which it then closes ("Connection closed by peer" in
        # connectFullMesh). Under a name of its own, what a stranger writes is never read.
        from outlast.train import collective

        store = None
        if context.world_rank == 0:
            store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), 0, context.world_size,
                                  is_master=True, timeout=timeout, wait_for_workers=False)
        port, name = collective.broadcast_from_rank_zero(
            (store.port, f"outlast-{secrets.token_hex(8)}") if store is not None else None)
        os.environ["MASTER_PORT"] = str(port)
        if store is None:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], port, context.world_size, is_master=False,
                                  timeout=timeout)
        dist.init_process_group(backend=backend, store=dist.PrefixStore(name, store), rank=context.world_rank,
                                world_size=context.world_size, timeout=timeout)

    def on_shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

