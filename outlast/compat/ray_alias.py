"""`import ray` inside `outlast run`: Ray Train's modules resolve to outlast's.

A meta-path finder, installed only in the process `outlast run` starts (and in that run's
workers, when the train function arrives referring to `ray`), answers for `ray` and its
submodules. A process that does not go through `outlast run` imports the real Ray, if it
has one: nothing here is installed on import.

- `ray.train`, `ray.train.v2.api.*` and the other modules of `TRAIN_MODULES` are
  `outlast.train`; `ray.train.torch` and `ray.train.v2.torch.*` are `outlast.train.torch`;
  the framework integrations (`FRAMEWORK_MODULES`: Lightning, Transformers, XGBoost, JAX) are
  outlast's modules of the same names.
- `ray.init()`, `ray.shutdown()` and `ray.is_initialized()` are accepted: outlast starts
  its own node for `fit()`, so a script that only trains needs nothing from them.
- `ray.data` is `outlast.data`: Ray Data's reads (`read_parquet`, `read_csv`, ...), its
  `from_*` builders and the transforms Ray Train scripts use, read a block at a time; a
  `ray.data` name outlast lacks stops the script with what to do instead.
- Any other Ray name or module stops the script at once (`UnsupportedRayAPI`, which an
  `except Exception` does not swallow), naming the call and the script's line.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import types
from typing import Any

log = logging.getLogger("outlast.compat")

RAY_VERSION = "2.60.0"  # the Ray release whose API docs/ray-parity.md compares with

TRAIN_MODULES = (
    "ray.train.v2", "ray.train.v2.api", "ray.train.v2.api.data_parallel_trainer", "ray.train.v2.api.config",
    "ray.train.v2.api.context", "ray.train.v2.api.exceptions", "ray.train.v2.api.preemption",
    "ray.train.v2.api.report_config", "ray.train.v2.api.reported_checkpoint", "ray.train.v2.api.result",
    "ray.train.v2.api.train_fn_utils", "ray.train.data_parallel_trainer", "ray.train.context", "ray.train.trainer",
)
TORCH_MODULES = ("ray.train.v2.torch", "ray.train.v2.torch.torch_trainer", "ray.train.v2.torch.train_loop_utils",
                 "ray.train.torch.torch_trainer", "ray.train.torch.config", "ray.train.torch.train_loop_utils")
# Ray Train's framework integrations: Ray's module -> outlast's.
FRAMEWORK_MODULES = {
    "ray.train.lightning": "outlast.train.lightning",
    "ray.train.huggingface": "outlast.train.huggingface",
    "ray.train.huggingface.transformers": "outlast.train.huggingface.transformers",
    "ray.train.xgboost": "outlast.train.xgboost",
    "ray.train.v2.xgboost": "outlast.train.xgboost",
    "ray.train.v2.xgboost.xgboost_trainer": "outlast.train.xgboost",
    "ray.train.lightgbm": "outlast.train.lightgbm",
    "ray.train.v2.lightgbm": "outlast.train.lightgbm",
    "ray.train.v2.lightgbm.lightgbm_trainer": "outlast.train.lightgbm",
    "ray.train.v2.jax": "outlast.train.jax",
    "ray.train.v2.jax.jax_trainer": "outlast.train.jax",
    "ray.train.v2.jax.config": "outlast.train.jax",
}
SUPPORTED = ("ray.train, ray.train.torch, ray.train.lightning, ray.train.huggingface.transformers, ray.train.xgboost, "
             "ray.train.lightgbm and ray.train.v2.jax; ray.init/shutdown/is_initialized; ray.data's reads, from_* builders and "
             "per-row and per-batch transforms")
NOT_SUPPORTED = ("ray.train.tensorflow, ray.train.horovod, Ray Tune, Ray Data pipelines, "
                 "Ray Serve, tasks and actors (ray.remote, ray.get, ray.put)")
DATA_NAMES = ("read_parquet", "read_csv", "read_json", "read_text", "read_images", "read_numpy", "read_binary_files",
              "from_items", "from_numpy", "from_pandas", "from_torch", "from_huggingface", "Dataset")


class UnsupportedRayAPI(BaseException):
    """A Ray API outlast does not offer was used under `outlast run`. A BaseException, so that a script's
    `except Exception` does not carry on past it."""


def _script_line() -> str:
    """Where the user's code is: the first frame outside outlast and the import machinery."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(here) and not name.startswith("<frozen") and "importlib" not in name:
            return f"{name}, line {frame.f_lineno}"
        frame = frame.f_back
    return "an unknown line"


def stop(what: str, instead: str = "") -> UnsupportedRayAPI:
    advice = instead or (f"outlast runs {SUPPORTED}, and nothing else of Ray ({NOT_SUPPORTED} are not "
                         "supported); see docs/ray-parity.md")
    return UnsupportedRayAPI(f"{what} at {_script_line()} is not supported under `outlast run`: {advice}")


class ShimModule(types.ModuleType):
    """A module that stands in for one of Ray's, handing out the names of `target` (an outlast module).

    Pickled by name: the worker that unpickles it installs the alias too (the train function reaches
    the workers referring to `ray`).
    """

    def __init__(self, name: str, target: str | None = None, advice: str = "") -> None:
        super().__init__(name)
        self.__path__ = []  # a package, so that `import ray.x.y` asks the finder for the rest
        self._target = target
        self._advice = advice

    def __reduce__(self):
        return (_module_in_worker, (self.__name__,))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_target", "_advice"):
            raise AttributeError(name)
        if f"{self.__name__}.{name}" in _aliases():  # `from ray import train`: a submodule not imported yet
            return importlib.import_module(f"{self.__name__}.{name}")
        if self._target is not None:
            try:
                return getattr(importlib.import_module(self._target), name)
            except ImportError as e:  # a Ray name outlast knows and does not offer: its message says why
                raise stop(f"{self.__name__}.{name}", str(e).split(": ", 1)[-1]) from None
            except AttributeError:
                pass
        raise stop(f"{self.__name__}.{name}", self._advice)


def _module_in_worker(name: str) -> types.ModuleType:
    install()
    return importlib.import_module(name)


def active() -> bool:
    return _finder is not None


class _InstallFirst:
    """Unpickled before the train function it travels with: the worker installs the alias before the
    function's module (which may `import ray.train` at its top) is imported."""

    def __reduce__(self):
        return (_install_marker, ())


def _install_marker() -> None:
    install()


def _carried(_marker: None, fn: Any) -> Any:
    return fn


class _Carried:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __reduce__(self):
        return (_carried, (_InstallFirst(), self.fn))


def carry(fn: Any) -> Any:
    """`fn`, pickled so that a worker installs the alias before unpickling it (and gets `fn` back)."""
    return _Carried(fn)


def _init(*args: Any, **kwargs: Any) -> None:
    global _initialized
    if not _initialized:
        log.info("ray.init() accepted and ignored: outlast starts (or finds) its own node when fit() runs")
    _initialized = True


def _shutdown(*args: Any, **kwargs: Any) -> None:
    global _initialized
    _initialized = False


_initialized = False


def _ray_module() -> ShimModule:
    ray = ShimModule("ray")
    ray.__version__ = RAY_VERSION
    ray.init = _init
    ray.shutdown = _shutdown
    ray.is_initialized = lambda: _initialized
    return ray


def _data_module() -> ShimModule:
    import outlast.data

    data = ShimModule("ray.data", advice=(
        f"outlast's ray.data offers {', '.join(DATA_NAMES)}; read the data with one of them, or build a torch "
        "DataLoader in the train function (see docs/ray-data-parity.md)"))
    for name in DATA_NAMES:  # only Ray's names: outlast.data's own (its errors) stay outlast's
        setattr(data, name, getattr(outlast.data, name))
    return data


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, make) -> None:
        self.make = make

    def create_module(self, spec):
        return self.make()

    def exec_module(self, module) -> None:
        pass


class _RefusingLoader(importlib.abc.Loader):
    def create_module(self, spec):
        raise stop(f"import {spec.name}")

    def exec_module(self, module) -> None:
        pass


class RayAliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "ray" and not fullname.startswith("ray."):
            return None
        make = _aliases().get(fullname)
        loader = _AliasLoader(make) if make is not None else _RefusingLoader()
        return importlib.machinery.ModuleSpec(fullname, loader, is_package=True)


def _aliases() -> dict[str, Any]:
    table: dict[str, Any] = {"ray": _ray_module, "ray.data": _data_module}
    for target, names in (("outlast.train", ("ray.train", *TRAIN_MODULES)),
                          ("outlast.train.torch", ("ray.train.torch", *TORCH_MODULES))):
        table.update({name: (lambda name=name, target=target: ShimModule(name, target)) for name in names})
    table.update({name: (lambda name=name, target=target: ShimModule(name, target))
                  for name, target in FRAMEWORK_MODULES.items()})
    return table


_finder: RayAliasFinder | None = None


def install() -> None:
    """Make `ray` outlast's in this process (a no-op when already so). Refuses if Ray is already imported."""
    global _finder
    if _finder is not None:
        return
    real = sys.modules.get("ray")
    if real is not None and not isinstance(real, ShimModule):
        raise RuntimeError("Ray is already imported in this process; `outlast run` must start the script itself")
    _finder = RayAliasFinder()
    sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    global _finder
    if _finder is not None:
        sys.meta_path.remove(_finder)
        _finder = None
    for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")]:
        del sys.modules[name]
