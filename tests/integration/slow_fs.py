"""A file system reached through fsspec whose deletes are slow, as on a big tree over NFS or a
throttled object store: `slowrm:///abs/path`. Importing this module registers it, in the driver and
in every worker that unpickles a function from here."""

from __future__ import annotations

import os
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem

DELETE_S_VAR = "OUTLAST_TEST_SLOW_DELETE_S"


class SlowDeleteFS(LocalFileSystem):
    protocol = ("slowrm",)
    root_marker = "/"

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("auto_mkdir", True)
        super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("slowrm://"):
            path = path[len("slowrm://"):]
        return super()._strip_protocol("/" + path.lstrip("/"))

    def rm(self, path, recursive=False, maxdepth=None):
        if "checkpoint_" in str(path):  # the deletes of checkpoints: retention's and those of uncommitted ones
            time.sleep(float(os.environ.get(DELETE_S_VAR, "8")))
        return super().rm(path, recursive=recursive, maxdepth=maxdepth)


fsspec.register_implementation("slowrm", SlowDeleteFS, clobber=True)


def counting_loop_on_slow_storage(config: dict) -> None:
    from tests.integration.jobs import counting_loop

    counting_loop(config)
