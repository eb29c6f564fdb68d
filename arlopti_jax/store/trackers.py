"""The experiment trackers of ``train.loggers``: TensorBoard, Weights & Biases, MLflow.

    check("tensorboard,wandb")               # start-up: ValueError naming what is wrong
    tracker = start("mlflow", Run(run_dir, "kk3b", "gs://b/runs/kk3b", TrackerIds(run_dir)), config_dict)
    tracker.scalars(step, {"reward/mean": 0.4}); tracker.text(step, "samples", "...")
    tracker.histogram(step, "pi_old", values); tracker.summary(step, text, {"summary/minutes": 3.0})
    tracker.close()

Each takes the run's config (once, at its start), its scalars, its sample texts (and
histograms, where the tracker has them) and the end-of-run summary. Settings come from the
trackers' own environment variables, so a run logs where its user's other runs do:

- ``tensorboard``: event files in ``run_dir/tb``; the config and the summary as text.
- ``wandb``: ``wandb.init`` with ``WANDB_PROJECT`` (default ``arlopti_jax``), ``WANDB_ENTITY``,
  ``WANDB_MODE`` (``offline``: files in ``run_dir/wandb`` for ``wandb sync``); texts as one-cell
  tables, the summary in the run's summary (``summary`` holds the text).
- ``mlflow``: a run in ``MLFLOW_EXPERIMENT_NAME`` (else the default experiment) of the store at
  ``MLFLOW_TRACKING_URI`` (else mlflow's default); the config as params and ``config.json``, texts
  as ``<tag>/step_<N>.txt`` artifacts, the summary as metrics and ``summary.txt``. MLflow has no
  histograms.

Both name their run after ``run_dir``'s last part (a bucket's too: ``gs://b/runs/kk3b`` is ``kk3b``,
not the host's staging folder), and keep its id in ``run_dir/trackers.json`` (``TrackerIds``): a run
that carries on from a checkpoint (a resumed or requeued one) logs into the same dashboard run
(W&B's ``resume="allow"`` with that id; the same MLflow run, RUNNING again).

TensorBoard and MLflow names take no '@': ``safe_name`` writes ``pass@4`` as ``pass_4``.
``check`` finds, before a run starts, a tracker whose package is missing or whose settings it
cannot use (a bad ``WANDB_MODE``, no W&B key while online, a tracking store mlflow cannot open).
``MetricsWriter`` turns a tracker that cannot start there either (a server that does not answer)
into a ``TrackerError``: the run stops in one line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
import time
from pathlib import Path

from arlopti_jax.config import LOGGERS
from arlopti_jax.runtime.startup import StartupError

log = logging.getLogger(__name__)

EXTRAS = {"wandb": "arlopti_jax[wandb]", "mlflow": "arlopti_jax[mlflow]"}
WANDB_OFF = ("offline", "disabled", "dryrun")
MLFLOW_PARAM_CHARS = 6000  # MLflow's longest param value
IDS_FILE = "trackers.json"  # in run_dir: each tracker's run id (``TrackerIds``)


class TrackerError(StartupError):
    """A tracker of ``train.loggers`` that could not start: the run stops in one line naming it."""


def run_name(run_dir) -> str:
    """The name a tracker gives a run: ``run_dir``'s last part (``gs://b/runs/kk3b/`` -> ``kk3b``)."""
    return str(run_dir).rstrip("/").rsplit("/", 1)[-1]


class TrackerIds:
    """``run_dir/trackers.json``: each tracker's id of the run's dashboard run. ``carry_on`` False
    (a run that starts over) forgets the ids there: its trackers start new runs."""

    def __init__(self, folder: Path, carry_on: bool = True):
        self.path = Path(folder) / IDS_FILE
        self._ids: dict = {}
        if carry_on and self.path.is_file():
            try:
                self._ids = dict(json.loads(self.path.read_text()))
            except (OSError, ValueError, TypeError) as err:
                log.warning("%s cannot be read (%s): the trackers start new runs", self.path, err)

    def get(self, name: str) -> dict:
        return dict(self._ids.get(name) or {})

    def put(self, name: str, entry: dict) -> None:
        self._ids[name] = entry
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self._ids, indent=2))
        os.replace(tmp, self.path)  # whole or not at all: a kill mid-write leaves the old file


@dataclasses.dataclass
class Run:
    """What a tracker is told of the run it logs."""

    folder: Path  # where the run's records are written (a bucket run's: this host's staging folder)
    name: str  # ``run_name`` of run_dir
    where: str  # run_dir as the run names it: a local folder's absolute path, or the bucket's URL
    ids: TrackerIds


def safe_name(key: str) -> str:
    """A metric name TensorBoard and MLflow accept: characters other than letters, digits and
    ``_ - . /`` become '_' (``eval/x/pass@4`` -> ``eval/x/pass_4``)."""
    return re.sub(r"[^\w./-]", "_", key)


def names(loggers: str) -> list[str]:
    return [name for name in str(loggers).split(",") if name]


def reason(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0].strip() if text else type(err).__name__


def _import(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ValueError(f"config.train.loggers: {name} is not installed ({reason(err)}); "
                         f"pip install '{EXTRAS[name]}'") from None


def check(loggers: str) -> None:
    """Raise ValueError (one line naming the tracker) for a tracker in ``loggers`` that cannot start:
    its package missing, or settings it refuses."""
    for name in names(loggers):
        if name == "wandb":
            wandb = _import("wandb")
            mode = os.environ.get("WANDB_MODE", "online")
            try:
                wandb.Settings(mode=mode)
            except Exception as err:  # pydantic's ValidationError: its second line says what is allowed
                lines = [line.strip() for line in str(err).splitlines() if line.strip()]
                raise ValueError(f"config.train.loggers: wandb: WANDB_MODE={mode!r}: "
                                 f"{lines[2] if len(lines) > 2 else reason(err)}") from None
            if mode not in WANDB_OFF and not wandb.login(prompt=False, verify=False):
                raise ValueError("config.train.loggers: wandb: no W&B API key (set WANDB_API_KEY, run `wandb login`, "
                                 "or set WANDB_MODE=offline)")
        elif name == "mlflow":
            mlflow = _import("mlflow")
            uri = mlflow.get_tracking_uri()
            try:
                mlflow.MlflowClient(tracking_uri=uri)  # opens the store: its scheme, its backend, its folder
            except Exception as err:
                raise ValueError(f"config.train.loggers: mlflow cannot open the tracking store {uri} "
                                 f"(MLFLOW_TRACKING_URI): {reason(err)}") from None


class TensorBoard:
    def __init__(self, run: Run, config: dict):
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(run.folder / "tb"))
        self._tb.add_text("config", f"```\n{json.dumps(config, indent=2, default=str)}\n```", 0)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._tb.add_scalar(safe_name(key), value, step)

    def histogram(self, step: int, tag: str, values) -> None:
        self._tb.add_histogram(tag, values, step)

    def text(self, step: int, tag: str, text: str) -> None:
        self._tb.add_text(tag, text, step)

    def summary(self, step: int, text: str, values: dict[str, float]) -> None:
        self.scalars(step, values)
        self.text(step, "summary", f"```\n{text}\n```")

    def flush(self) -> None:
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()


class Wandb:
    def __init__(self, run: Run, config: dict):
        import wandb

        self._wandb = wandb
        run_id = run.ids.get("wandb").get("id") or secrets.token_hex(6)  # W&B's ids: [a-z0-9], unique per project
        run.ids.put("wandb", {"id": run_id})  # before the run starts: a kill during init keeps it
        # a resumed run's config may differ from the first's (resume=auto, more steps): allowed
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "arlopti_jax", id=run_id, resume="allow",
                              name=run.name, dir=str(run.folder), config=config, allow_val_change=True,
                              reinit="finish_previous")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def histogram(self, step: int, tag: str, values) -> None:
        self.run.log({tag: self._wandb.Histogram(values)}, step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.run.log({tag: self._wandb.Table(columns=["text"], data=[[text]])}, step=step)

    def summary(self, step: int, text: str, values: dict[str, float]) -> None:
        self.run.summary.update({**values, "summary": text})

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


def _flat(tree: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:MLFLOW_PARAM_CHARS]
    return out


class Mlflow:
    def __init__(self, run: Run, config: dict):
        import mlflow
        from mlflow.entities import Param

        self._entities = mlflow.entities
        self.client = mlflow.MlflowClient()
        uri = mlflow.get_tracking_uri()
        logged = self._resume(run.ids.get("mlflow"), uri)
        if logged is None:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME")
            if experiment:
                found = self.client.get_experiment_by_name(experiment)
                experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            else:
                experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"
            self.run_id = self.client.create_run(experiment_id, run_name=run.name,
                                                 tags={"run_dir": run.where}).info.run_id
            logged = {}
        run.ids.put("mlflow", {"run_id": self.run_id, "tracking_uri": uri})
        # a param once logged cannot change in MLflow: a resumed run adds the ones its run lacks
        params = [Param(k, v) for k, v in _flat(config).items() if k not in logged]
        for start in range(0, len(params), 100):  # MLflow's most params per call
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        if not logged:
            self.client.log_dict(self.run_id, config, "config.json")

    def _resume(self, entry: dict, uri: str) -> dict | None:
        """The params of the run ``entry`` names, RUNNING again, when it is in the store at ``uri``; else None."""
        from mlflow.exceptions import MlflowException

        if not entry.get("run_id") or entry.get("tracking_uri") != uri:
            return None
        try:
            found = self.client.get_run(entry["run_id"])
        except MlflowException:  # deleted, or the store was emptied: a new run
            return None
        if found.info.lifecycle_stage != "active":
            return None
        self.run_id = found.info.run_id
        self.client.update_run(self.run_id, status="RUNNING")
        return dict(found.data.params)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        stamp = int(time.time() * 1000)
        metrics = [self._entities.Metric(safe_name(k), v, stamp, step) for k, v in values.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's most metrics per call
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def histogram(self, step: int, tag: str, values) -> None:
        pass  # MLflow has no histograms

    def text(self, step: int, tag: str, text: str) -> None:
        self.client.log_text(self.run_id, text, f"{safe_name(tag)}/step_{step:08d}.txt")

    def summary(self, step: int, text: str, values: dict[str, float]) -> None:
        self.scalars(step, values)
        self.client.log_text(self.run_id, text, "summary.txt")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": Mlflow}
assert tuple(TRACKERS) == LOGGERS, "config.LOGGERS and the trackers here name the same trackers"


def start(name: str, run: Run, config: dict):
    return TRACKERS[name](run, config)
