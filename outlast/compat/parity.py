"""docs/ray-parity.md: every public name and argument of `ray.train`, `ray.train.torch` and Ray Train's
framework integrations,
against outlast's, generated from both APIs.

Ray's side is read from the source files of its wheel with `ast` (`ray_api.py`): the table
needs no Ray installation, which would pull in several hundred megabytes of dependencies
(pyarrow, pandas, grpc) for what the source files say exactly. outlast's side is imported
and inspected. What signatures cannot show (semantics) is written down in NOTES below, and
where outlast refuses an argument, the error quoted is produced by calling outlast.

    python -m outlast.compat.parity [--check]   # write docs/ray-parity.md, or fail if it is stale
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from outlast.compat.ray_alias import RAY_VERSION
from outlast.compat.ray_api import ApiName, Param, ray_train_api

DOC = Path(__file__).parents[2] / "docs" / "ray-parity.md"
# Every module of Ray Train that a user imports, and outlast's (None: outlast has none).
MODULES: dict[str, str | None] = {
    "ray.train": "outlast.train", "ray.train.torch": "outlast.train.torch",
    "ray.train.lightning": "outlast.train.lightning",
    "ray.train.huggingface.transformers": "outlast.train.huggingface.transformers",
    "ray.train.xgboost": "outlast.train.xgboost", "ray.train.v2.jax": "outlast.train.jax",
    "ray.train.lightgbm": "outlast.train.lightgbm", "ray.train.tensorflow": None, "ray.train.horovod": None,
}

SAME, DIFFERS, UNSUPPORTED, DEPRECATED = "same", "differs", "not supported", "deprecated in Ray"


@dataclass(frozen=True)
class Note:
    status: str
    text: str
    probe: Callable[[], Any] | None = None  # raises the error a user gets; its message is quoted


def _train():
    return importlib.import_module("outlast.train")


def _torch():
    return importlib.import_module("outlast.train.torch")


_OUTLAST_URL = "give storage paths as URLs (s3://bucket/prefix, gs://...)"
NOTES: dict[str, Note] = {
    "report.metrics": Note(DIFFERS, "kept in the run's history on storage, as JSON keeps them (NaN and the infinities "
                                    "included, docs/json.md): a value JSON would change (a set, bytes, an object) "
                                    "raises TypeError at the report naming its key, where Ray keeps it in memory",
                           lambda: importlib.import_module("outlast.train.metric_types").check_metrics({"classes": {"cat"}})),
    "RunConfig.name": Note(DIFFERS, "one directory name, checked when the RunConfig is made: at most 242 bytes, "
                                    "no '/' or control characters, not '.' or '..'",
                           lambda: _train().RunConfig(name="two\nlines")),
    "RunConfig.storage_path": Note(DIFFERS, "an empty string is refused (None is the default: $OUTLAST_STORAGE_PATH, "
                                            "else ~/outlast_results)",
                                   lambda: _train().RunConfig(storage_path="")),
    "report.checkpoint_dir_name": Note(DIFFERS, "the checkpoint is stored under the name given, as on Ray. A name the run "
                                                "already holds (Ray writes the files over it), or that is not one "
                                                "directory name, raises CheckpointNameError before anything is written; "
                                                "ranks with files for one report pass the same name (Ray takes rank 0's)"),
    "report.checkpoint_upload_fn": Note(UNSUPPORTED, "", lambda: _train().report({}, checkpoint_upload_fn=print)),
    "report.validation": Note(UNSUPPORTED, "", lambda: _train().report({}, validation=True)),
    "get_all_reported_checkpoints": Note(DIFFERS, "the committed checkpoints still kept, ordered as Ray orders them "
                                                  "(by score, the best last), once every checkpoint the rank reported "
                                                  "(ASYNC ones too) is committed or refused, as Ray waits for its "
                                                  "reports in flight"),
    "get_all_reported_checkpoints.consistency_mode": Note(DIFFERS, "outlast has no validation: COMMITTED and VALIDATED "
                                                                   "both give the committed checkpoints"),
    "get_all_reported_checkpoints.timeout_s": Note(DIFFERS, "accepted and not applied: the wait ends with the commits, and every commit "
                                                            "ends (refused at worst, after storage's retries)"),
    "get_dataset_shard": Note(DIFFERS, "the dataset given to the trainer (torch Dataset, Hugging Face "
                                       "datasets.Dataset, numpy/torch arrays, dict of columns, pandas DataFrame, list "
                                       "of rows, or a ray.data dataset under `outlast run`, read by each rank from the "
                                       "blocks that hold its rows), cut into equal contiguous shards; the shard offers iter_torch_batches, "
                                       "iter_batches, iter_rows and count, not Ray Data's other methods; each walk "
                                       "of what they return is one epoch, and every checkpoint keeps the position, "
                                       "so a restore goes on at the next batch (docs/guide/training.md)"),
    "Checkpoint.filesystem": Note(UNSUPPORTED, f"{_OUTLAST_URL}: Checkpoint('s3://bucket/run/checkpoint_001_000004')"),
    "Checkpoint.set_metadata": Note(DIFFERS, "refused on a committed checkpoint (its files are checked against its "
                                             "manifest): set metadata before report()"),
    "Checkpoint.update_metadata": Note(DIFFERS, "refused on a committed checkpoint, as set_metadata"),
    "CheckpointConfig": Note(DIFFERS, "outlast adds `duplicate_files`: ranks writing one file with different contents "
                                      "keep rank 0's copy ('keep_rank0', the default; storage never lets another "
                                      "rank replace it) or fail the checkpoint ('fail'); Ray keeps one copy "
                                      "without a word"),
    "CheckpointUploadMode.NO_UPLOAD": Note(UNSUPPORTED, "outlast uploads every reported checkpoint itself"),
    "DataConfig.execution_options": Note(UNSUPPORTED, "", lambda: _train().DataConfig(execution_options={})),
    "DataConfig.enable_shard_locality": Note(DIFFERS, "accepted; shards are cut in memory, with no locality to keep"),
    "DataConfig.configure": Note(UNSUPPORTED, "Ray Data's ingest; outlast cuts the shards itself"),
    "DataConfig.default_ingest_options": Note(UNSUPPORTED, "Ray Data's ingest; outlast cuts the shards itself"),
    "FailureConfig.controller_failure_limit": Note(UNSUPPORTED, "the driver is outlast's controller: run the script "
                                                               "again with the same RunConfig(name, storage_path) and "
                                                               "the run continues from its latest checkpoint"),
    "Result": Note(DIFFERS, "outlast adds `last_metrics`, rank 0's last report (with a checkpoint or without)"),
    "Result.metrics": Note(SAME, "the metrics reported with the latest checkpoint, None without one"),
    "Result.best_checkpoints": Note(SAME, "the kept checkpoints ordered by checkpoint_score_attribute, the best last "
                                          "(report order without one), at most num_to_keep"),
    "Result.error": Note(SAME, "fit() raises the error; a Result from fit() has none"),
    "Result.metrics_dataframe": Note(DIFFERS, "built from best_checkpoints when read; needs pandas"),
    "Result.filesystem": Note(SAME, "a pyarrow file system (pyarrow's own for a local path, the URL's fsspec file "
                                    "system wrapped for pyarrow otherwise); the fsspec one without pyarrow"),
    "Result.from_path.storage_filesystem": Note(UNSUPPORTED, "",
                                                lambda: _train().Result.from_path("/tmp/run", storage_filesystem=1)),
    "Result.return_value": Note(DIFFERS, "rank 0's return value, for the driver whose workers returned it: None "
                                          "unless the run finished, and None from Result.from_path (a pickle on "
                                          "storage is unpickled only under the run's own seal)"),
    "RunConfig.storage_filesystem": Note(UNSUPPORTED, "", lambda: _train().RunConfig(storage_filesystem=object())),
    "RunConfig.callbacks": Note(UNSUPPORTED, "", lambda: _train().RunConfig(callbacks=[print])),
    "RunConfig.worker_runtime_env": Note(DIFFERS, "only env_vars", lambda: _train().RunConfig(
        worker_runtime_env={"pip": ["x"]})),
    "RunConfig.logging_config": Note(UNSUPPORTED, "outlast logs through Python's logging ('outlast' logger)"),
    "RunConfig.storage_context": Note(UNSUPPORTED, "Ray's storage internals; the run lives at {storage_path}/{name}"),
    "ScalingConfig.num_workers": Note(SAME, "an int, or (min, max) for an elastic run: each attempt takes the most "
                                            "that fit and a run below max grows when room appears"),
    "ScalingConfig.trainer_resources": Note(UNSUPPORTED, "the driver runs where fit() is called and reserves nothing"),
    "ScalingConfig.accelerator_type": Note(DIFFERS, "asks each rank 0.001 of the resource 'accelerator_type:<type>', "
                                                    "which a node offers with `outlast start --resources "
                                                    "accelerator_type:A100=1`"),
    "ScalingConfig.label_selector": Note(UNSUPPORTED, "", lambda: _train().ScalingConfig(label_selector={"a": "b"})),
    "ScalingConfig.use_tpu": Note(UNSUPPORTED, "outlast trains with torch.distributed on CPUs and CUDA GPUs"),
    "ScalingConfig.topology": Note(UNSUPPORTED, "outlast trains with torch.distributed on CPUs and CUDA GPUs"),
    "ScalingConfig.elastic_resize_monitor_interval_s": Note(DIFFERS, "the least time between two resizes: outlast "
                                                                     "sees room appear in its node table, not by a "
                                                                     "poll at this interval"),
    "TrainContext.get_storage": Note(UNSUPPORTED, "get_storage_path() gives where the run lives"),
    "TrainingFailedError": Note(DIFFERS, "outlast's takes (message, failures): `failures` lists every failure (rank, "
                                         "pid, node, exit code or signal, traceback), root cause first"),
    "WorkerGroupError": Note(DIFFERS, "a TrainingFailedError whose last attempt ended with failed workers; "
                                      "worker_failures maps each rank to a WorkerFailure (its `record` has the details)"),
    "ControllerError": Note(DIFFERS, "any other stop (no node answered, the run's lease lost, workers never started)"),
    "PreemptionError": Note(DIFFERS, "a TrainingFailedError carrying the preemptions among its failures"),
    "PreemptionError.preemption_info": Note(UNSUPPORTED, "the preemptions are among the error's `failures` "
                                                         "(kind 'Preemption', with the node and deadline)"),
    "PreemptionError.drain_timed_out": Note(UNSUPPORTED, "the run's history says whether the deadline passed"),
    "WorkerGroupError.error_message": Note(DIFFERS, "the constructor takes (message, failures); str(error) is the "
                                                    "message"),
    "WorkerGroupError.worker_failures": Note(DIFFERS, "an attribute of the raised error; the constructor takes "
                                                      "(message, failures)"),
    "ControllerError.controller_failure": Note(DIFFERS, "an attribute of the raised error; the constructor takes "
                                                        "(message, failures)"),
    "ReportedCheckpointStatus": Note(DIFFERS, "outlast has no validation: every reported checkpoint is COMMITTED"),
    "TorchTrainer": Note(DIFFERS, "outlast adds `isolation` (resource isolation of the node fit() starts)"),
    "TorchTrainer.validation_config": Note(UNSUPPORTED, "", lambda: _torch().TorchTrainer(print, validation_config=1)),
    "TorchTrainer.resume_from_checkpoint": Note(UNSUPPORTED, "", lambda: _torch().TorchTrainer(
        print, resume_from_checkpoint=1)),
    "TorchTrainer.metadata": Note(DIFFERS, "accepted and not used (deprecated in Ray)"),
    "TorchConfig.backend_cls": Note(UNSUPPORTED, "Ray's backend internals"),
    "TorchConfig.framework": Note(UNSUPPORTED, "Ray's backend internals"),
    "TorchConfig.to_dict": Note(UNSUPPORTED, "Ray's backend internals"),
    "TorchConfig.train_func_context": Note(UNSUPPORTED, "Ray's backend internals"),
    "prepare_data_loader": Note(SAME, "what it returns reads like the DataLoader it wraps (dataset, batch_size, "
                                      "sampler, len); a loader with its default sampler is split by outlast's own "
                                      "batch sampler, whose place every checkpoint keeps, so a restore goes on at "
                                      "the next batch: each rank reads a DistributedSampler's rows in its order, "
                                      "but where the dataset's length does not divide by the workers, the last "
                                      "`len % workers` rows of the epoch's order are left out (a DistributedSampler "
                                      "repeats its first rows instead, so that every rank has as many) "
                                      "(docs/guide/training.md)"),
    "prepare_data_loader.auto_transfer": Note(DIFFERS, "accepted; batches move to the device as they are read, "
                                                       "without a side stream"),
    "get_devices": Note(SAME, "one device per worker"),
    "ray.train.lightning:RayTrainReportCallback.validation": Note(UNSUPPORTED, "outlast has no validation step: Lightning's validation "
                                                           "loop's metrics are reported with the checkpoint"),
    "ray.train.lightning:RayFSDPStrategy": Note(DIFFERS, "on Lightning >= 2.1, whose FSDPStrategy saves full or sharded state itself; "
                                     "Ray's own state-dict gathering for Lightning 2.0 is not kept; untested here "
                                     "(no GPUs)"),
    "ray.train.lightning:RayDeepSpeedStrategy": Note(DIFFERS, "needs deepspeed installed; untested here (no GPUs)"),
    "ray.train.lightning:prepare_trainer": Note(SAME, "checks the strategy and the cluster environment"),
    "ray.train.huggingface.transformers:prepare_trainer": Note(SAME, "a train or eval dataset may be an iterator of "
                                                                     "batches (get_dataset_shard(name)"
                                                                     ".iter_torch_batches(...))"),
    "ray.train.xgboost:RayTrainReportCallback.filename": Note(SAME, "'model.ubj', Ray's "
                                                                    "RayReportCallback.CHECKPOINT_NAME"),
    "ray.train.xgboost:RayTrainReportCallback.get_model.filename": Note(SAME, "'model.ubj', as on Ray"),
    "ray.train.xgboost:XGBoostTrainer": Note(DIFFERS, "rank 0 runs XGBoost's RabitTracker for each attempt (Ray runs it in its "
                                    "driver); a lone worker trains without one, as on Ray"),
    "ray.train.xgboost:XGBoostTrainer.validation_config": Note(UNSUPPORTED, "validate in the train function and report the validation "
                                                          "metrics with the checkpoint"),
    "ray.train.xgboost:XGBoostTrainer.resume_from_checkpoint": Note(UNSUPPORTED, "a run continues from its own latest checkpoint "
                                                               "(RayTrainReportCallback.get_model(get_checkpoint()))"),
    "ray.train.xgboost:XGBoostTrainer.metadata": Note(DIFFERS, "accepted and not used (deprecated in Ray)"),
    "ray.train.xgboost:XGBoostConfig.backend_cls": Note(UNSUPPORTED, "Ray's backend internals"),
    "ray.train.xgboost:XGBoostConfig.framework": Note(UNSUPPORTED, "Ray's backend internals"),
    "ray.train.xgboost:XGBoostConfig.to_dict": Note(UNSUPPORTED, "Ray's backend internals"),
    "ray.train.xgboost:XGBoostConfig.train_func_context": Note(UNSUPPORTED, "Ray's backend internals: outlast enters XGBoost's "
                                                          "CommunicatorContext around the train function itself"),
    "ray.train.xgboost:XGBoostCheckpoint": Note(UNSUPPORTED, "deprecated in Ray: save with RayTrainReportCallback, read with "
                                           "RayTrainReportCallback.get_model(checkpoint)"),
    "ray.train.lightgbm:RayTrainReportCallback.filename": Note(SAME, "'model.txt', Ray's "
                                                                     "RayReportCallback.CHECKPOINT_NAME"),
    "ray.train.lightgbm:RayTrainReportCallback.get_model.filename": Note(SAME, "'model.txt', as on Ray"),
    "ray.train.lightgbm:LightGBMTrainer": Note(DIFFERS, "the ranks exchange the addresses LightGBM listens on through "
                                                        "outlast's collective (Ray's driver gathers them); a restarted "
                                                        "attempt gets new ports"),
    "ray.train.lightgbm:LightGBMTrainer.validation_config": Note(UNSUPPORTED, "validate in the train function and report "
                                                                             "the validation metrics with the checkpoint"),
    "ray.train.lightgbm:LightGBMTrainer.resume_from_checkpoint": Note(UNSUPPORTED, "a run continues from its own latest "
                                                                    "checkpoint (lightgbm.train(init_model="
                                                                    "RayTrainReportCallback.get_model(get_checkpoint())))"),
    "ray.train.lightgbm:LightGBMTrainer.metadata": Note(DIFFERS, "accepted and not used (deprecated in Ray)"),
    "ray.train.lightgbm:LightGBMConfig.backend_cls": Note(UNSUPPORTED, "Ray's backend internals"),
    "ray.train.lightgbm:LightGBMConfig.framework": Note(UNSUPPORTED, "Ray's backend internals"),
    "ray.train.lightgbm:LightGBMConfig.to_dict": Note(UNSUPPORTED, "Ray's backend internals"),
    "ray.train.lightgbm:LightGBMConfig.train_func_context": Note(UNSUPPORTED, "Ray's backend internals"),
    "ray.train.lightgbm:LightGBMCheckpoint": Note(UNSUPPORTED, "deprecated in Ray: save with RayTrainReportCallback, read "
                                                              "with RayTrainReportCallback.get_model(checkpoint)"),
    "ray.train.v2.jax:JaxTrainer": Note(DIFFERS, "tested on CPUs (JAX_PLATFORMS=cpu with JaxConfig(use_gpu=True) runs JAX's "
                                "multi-process runtime there, as on Ray); the CUDA and TPU branches follow Ray's "
                                "code untested; one TPU slice per run (no MEGASCALE_* multi-slice)"),
    "ray.train.v2.jax:JaxTrainer.validation_config": Note(UNSUPPORTED, "validate in the train function and report the validation "
                                                      "metrics with the checkpoint"),
    "ray.train.v2.jax:JaxConfig.backend_cls": Note(UNSUPPORTED, "Ray's backend internals"),
    "ray.train.v2.jax:JaxConfig.framework": Note(UNSUPPORTED, "Ray's backend internals"),
    "ray.train.v2.jax:JaxConfig.to_dict": Note(UNSUPPORTED, "Ray's backend internals"),
    "ray.train.v2.jax:JaxConfig.train_func_context": Note(UNSUPPORTED, "Ray's backend internals"),
}


def _error(probe: Callable[[], Any]) -> str:
    try:
        probe()
    except BaseException as e:  # the probe exists to raise
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"{probe} raised nothing: NOTES is out of date")


@dataclass
class Row:
    name: str
    status: str
    text: str


def _signature(obj: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def _default_matches(ray_default: str | None, ours: Any) -> bool:
    """Whether outlast accepts every call Ray accepts, with the same meaning when the argument is left out."""
    import ast
    import dataclasses

    if ray_default is None:
        return True  # required on Ray: any default of outlast's takes the same calls
    if ours is inspect.Parameter.empty:
        return False
    if ours is dataclasses._HAS_DEFAULT_FACTORY and ray_default == "None":
        return True  # a fresh default value where Ray has None, which outlast reads the same way
    try:
        return ast.literal_eval(ray_default) == ours
    except (ValueError, SyntaxError):
        # A name such as CheckpointUploadMode.SYNC: compare its last part with outlast's value.
        return ray_default.rsplit(".", 1)[-1] == str(ours).rsplit(".", 1)[-1]


_module = ""  # the Ray module whose names are being compared: its notes are keyed "module:name"


def _note(key: str) -> Note | None:
    return NOTES.get(f"{_module}:{key}") or (NOTES.get(key) if _module in ("ray.train", "ray.train.torch") else None)


def _with_note(key: str, status: str, text: str) -> Row:
    note = _note(key)
    if note is None:
        return Row(key, status, text)
    parts = [note.text] if note.text else []
    if note.probe is not None:
        parts.append(f"`{_error(note.probe)}`")
    return Row(key, note.status, "; ".join(p for p in [*parts, text if status != SAME else ""] if p))


def _param_rows(owner: str, params: list[Param], target: Any) -> list[Row]:
    sig = _signature(target)
    ours = sig.parameters if sig is not None else {}
    rows = []
    for p in params:
        key = f"{owner}.{p.name}"
        if p.default == "_DEPRECATED":
            rows.append(Row(key, DEPRECATED, "deprecated in Ray " + RAY_VERSION + ("; outlast does not take it"
                                                                                    if p.name not in ours else "")))
        elif p.name not in ours and hasattr(target, p.name):
            rows.append(_with_note(key, DIFFERS, "computed by outlast, not a constructor argument"))
        elif p.name not in ours:
            rows.append(_with_note(key, UNSUPPORTED, f"`TypeError: unexpected keyword argument '{p.name}'`"))
        elif _default_matches(p.default, ours[p.name].default):
            rows.append(_with_note(key, SAME, ""))
        else:
            ray_default = "required" if p.default is None else f"`{p.default}`"
            our_default = "required" if ours[p.name].default is inspect.Parameter.empty \
                else f"`{ours[p.name].default!r}`"
            rows.append(_with_note(key, DIFFERS, f"default {our_default} (Ray: {ray_default})"))
    return rows


def _compare(module: str, api: ApiName) -> list[Row]:
    global _module
    _module = module
    if MODULES[module] is None:
        return [Row(api.name, UNSUPPORTED, f"`import {module}` stops the script under `outlast run`")]
    target_module = importlib.import_module(MODULES[module])
    try:
        obj = getattr(target_module, api.name)
    except ImportError as e:
        return [Row(api.name, DEPRECATED if api.deprecated else UNSUPPORTED, f"`ImportError: {e}`")]
    except AttributeError:
        return [_with_note(api.name, UNSUPPORTED, f"`ImportError: cannot import name '{api.name}'`")]
    if api.deprecated:
        return [Row(api.name, DEPRECATED, "deprecated in Ray " + RAY_VERSION)]
    if api.kind == "constant":
        same = repr(obj) == api.value or str(obj) == api.value
        return [_with_note(api.name, SAME if same else DIFFERS, "" if same else f"`{obj!r}` (Ray: `{api.value}`)")]
    rows = [_with_note(api.name, SAME, "")]
    if api.kind == "enum":
        for member in api.members:
            key = f"{api.name}.{member.name}"
            rows.append(_with_note(key, SAME, "") if hasattr(obj, member.name)
                        else _with_note(key, UNSUPPORTED, f"`AttributeError: {member.name}`"))
        return rows
    rows += _param_rows(api.name, api.params, obj)
    for member in api.members:
        key = f"{api.name}.{member.name}"
        if member.deprecated:
            rows.append(Row(key, DEPRECATED, "deprecated in Ray " + RAY_VERSION))
            continue
        ours = inspect.getattr_static(obj, member.name, None)
        if ours is None:
            rows.append(_with_note(key, UNSUPPORTED, f"`AttributeError: {member.name}`"))
            continue
        rows.append(_with_note(key, SAME, ""))
        if member.kind == "method":
            rows += _param_rows(key, member.params, getattr(obj, member.name))
    # A name whose arguments differ differs itself.
    if rows[0].status == SAME and any(r.status in (DIFFERS, UNSUPPORTED) for r in rows[1:]):
        rows[0] = Row(rows[0].name, DIFFERS, rows[0].text or "see its arguments")
    return rows


def render(api: dict[str, list[ApiName]]) -> str:
    out = [
        f"# Ray Train {RAY_VERSION} and outlast, name by name",
        "",
        "Generated by `python -m outlast.compat.parity` from Ray's source (the wheel of Ray "
        f"{RAY_VERSION}, read with `ast`) and outlast's code; `tests/compat/test_parity.py` fails when "
        "this file is stale. Every public name of each module of Ray Train that a user imports (their "
        "`__all__`, Ray Train V2), each argument, method and property: **same**, **differs** (how), **not supported** (why, "
        "and the error a user gets), or **deprecated in Ray**. Under `outlast run` an unsupported name stops "
        "the script with the same message and the script's line. Ray Data's names (`ray.data.read_parquet`, "
        "`Dataset.map_batches`, ...), which `outlast run` maps to `outlast.data`, are in "
        "[ray-data-parity.md](ray-data-parity.md).",
        "",
    ]
    totals: dict[str, int] = {}
    for module, names in api.items():
        ours = f"`{MODULES[module]}`" if MODULES[module] else "none: not supported"
        out += [f"## `{module}` → {ours}", "", "| name | status | notes |", "|---|---|---|"]
        for name in names:
            for i, row in enumerate(_compare(module, name)):
                label = f"`{row.name}`" if i == 0 else f"&nbsp;&nbsp;`{row.name}`"
                text = row.text.replace("|", "\\|").replace("\n", " ")
                out.append(f"| {label} | {row.status} | {text} |")
                if i == 0:
                    totals[f"{module} {row.status}"] = totals.get(f"{module} {row.status}", 0) + 1
        out.append("")
    out += ["## Totals (names, not arguments)", ""]
    out += [f"- `{k.split()[0]}`: {v} {k.split(' ', 1)[1]}" for k, v in sorted(totals.items())]
    return "\n".join(out) + "\n"


def generate(root: Path | None = None) -> str:
    from outlast.compat.ray_source import ray_source

    return render(ray_train_api(root or ray_source(), tuple(MODULES)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m outlast.compat.parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help=f"fail if {DOC.name} differs from what would be generated")
    args = p.parse_args(argv)
    text = generate()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale: run `python -m outlast.compat.parity`", file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
