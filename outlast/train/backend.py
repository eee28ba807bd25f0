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
