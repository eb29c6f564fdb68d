"""The experiment trackers of ``train.loggers``: TensorBoard, Weights & Biases, MLflow.

    check("tensorboard,wandb")               # start-up: ValueError naming what is wrong
    tracker = start("mlflow", run_dir, config_dict)
    tracker.scalars(step, {"reward/mean": 0.4}); tracker.text(step, "samples", "...")
    tracker.histogram(step, "pi_old", values); tracker.summary(step, text, {"summary/minutes": 3.0})
    tracker.close()

Each takes the run's config (once, at its start), its scalars, its sample texts (and
histograms, where the tracker has them) and the end-of-run summary. Settings come from the
trackers' own environment variables, so a run logs where its user's other runs do:

- ``tensorboard``: event files in ``run_dir/tb``; the config and the summary as text.
- ``wandb``: ``wandb.init`` with ``WANDB_PROJECT`` (default ``arlopti_jax``), ``WANDB_ENTITY``,
  ``WANDB_MODE`` (``offline``: files in ``run_dir/wandb`` for ``wandb sync``), the run named after
  ``run_dir``; texts as one-cell tables, the summary in the run's summary (``summary`` holds the
  text).
- ``mlflow``: a run in ``MLFLOW_EXPERIMENT_NAME`` (else the default experiment) of the store at
  ``MLFLOW_TRACKING_URI`` (else mlflow's default); the config as params and ``config.json``, texts
  as ``<tag>/step_<N>.txt`` artifacts, the summary as metrics and ``summary.txt``. MLflow has no
  histograms.

TensorBoard and MLflow names take no '@': ``safe_name`` writes ``pass@4`` as ``pass_4``.
``check`` finds, before a run starts, a tracker whose package is missing or whose settings it
cannot use (a bad ``WANDB_MODE``, no W&B key while online, a tracking store mlflow cannot open).
A resumed run starts a new tracker run that carries on from its checkpoint's step.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from arlopti_jax.config import LOGGERS

EXTRAS = {"wandb": "arlopti_jax[wandb]", "mlflow": "arlopti_jax[mlflow]"}
WANDB_OFF = ("offline", "disabled", "dryrun")
MLFLOW_PARAM_CHARS = 6000  # MLflow's longest param value


def safe_name(key: str) -> str:
    """A metric name TensorBoard and MLflow accept: characters other than letters, digits and
    ``_ - . /`` become '_' (``eval/x/pass@4`` -> ``eval/x/pass_4``)."""
    return re.sub(r"[^\w./-]", "_", key)


def names(loggers: str) -> list[str]:
    return [name for name in str(loggers).split(",") if name]


def _reason(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0].strip() if text else type(err).__name__


def _import(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ValueError(f"config.train.loggers: {name} is not installed ({_reason(err)}); "
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
                                 f"{lines[2] if len(lines) > 2 else _reason(err)}") from None
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
                                 f"(MLFLOW_TRACKING_URI): {_reason(err)}") from None


class TensorBoard:
    def __init__(self, run_dir: Path, config: dict):
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(run_dir / "tb"))
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
    def __init__(self, run_dir: Path, config: dict):
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "arlopti_jax", name=run_dir.name,
                              dir=str(run_dir), config=config, reinit="finish_previous")

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
    def __init__(self, run_dir: Path, config: dict):
        import mlflow
        from mlflow.entities import Param

        self._entities = mlflow.entities
        self.client = mlflow.MlflowClient()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if experiment:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        else:
            experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name,
                                             tags={"run_dir": str(run_dir.absolute())}).info.run_id
        params = [Param(k, v) for k, v in _flat(config).items()]
        for start in range(0, len(params), 100):  # MLflow's most params per call
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.client.log_dict(self.run_id, config, "config.json")

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


def start(name: str, run_dir: Path, config: dict):
    return TRACKERS[name](run_dir, config)
