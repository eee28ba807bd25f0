"""What a trainer sets up in each worker around the train function."""

from __future__ import annotations

from outlast.train.context import TrainContext


class Backend:
    """The generic trainer's backend: nothing to set up.

    `preload` names the modules the fork server imports once, so forked workers start
    with them already imported. `needs_rendezvous` asks the controller for a free
    port per attempt (exported as MASTER_ADDR and MASTER_PORT).
    """

    preload: tuple[str, ...] = ()
    needs_rendezvous = False

    def on_start(self, context: TrainContext) -> None:
        pass

    def on_shutdown(self) -> None:
        pass


class WithDatasets(Backend):
    """A trainer's backend plus its datasets: each worker cuts its shard before the train function starts."""

    def __init__(self, inner: Backend, datasets: dict, config) -> None:
        self.inner = inner
        self.datasets = datasets
        self.config = config
        self.preload = inner.preload
        self.needs_rendezvous = inner.needs_rendezvous

    def on_start(self, context: TrainContext) -> None:
        from outlast.train import positions
        from outlast.train.data import install_shards

        install_shards(self.datasets, self.config, context.world_rank, context.world_size,
                       positions.shared_seed(context))
        self.inner.on_start(context)

    def on_shutdown(self) -> None:
        self.inner.on_shutdown()
