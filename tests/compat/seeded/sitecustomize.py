"""Seeds torch's default generator as torch is imported, in every process that has this folder on its
PYTHONPATH: the driver and each worker, under Ray or under `outlast run`. A Ray example that builds its model
from torch's default generator then starts from the same weights on both, with its source unchanged.

Only the folder's presence on PYTHONPATH turns this on (tests/compat/record_ray_metrics.py and the test that
reads its record put it there).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

SEED = 0


class _SeedAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once: torch's own submodules import as usual
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.manual_seed(SEED)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _SeedAfterImport())
