"""Experiment trackers: TensorBoard and CSV through Lightning Fabric's loggers, Weights & Biases and MLflow
through their own clients (Fabric ships no logger for either; these follow its ``Logger`` interface:
``log_metrics``, ``log_hyperparams``, ``finalize``), each receiving the same scalars, the resolved config and
the samples (train/sampling.py). Rank 0 only (train/metrics.py holds the list).

| tracker | where | config | samples |
|---|---|---|---|
| TensorBoard | ``<run>/tensorboard`` | text ``config`` (YAML) | ``samples/text``, ``samples/images`` |
| CSV | ``<run>/csv/metrics.csv`` | (``<run>/config.yaml``) | (``<run>/samples``) |
| W&B | ``<run>/wandb`` (offline) or online | the run's config | a table and an image |
| MLflow | ``<run>/mlflow.db`` or ``logger.mlflow_tracking_uri`` | params (flattened) and ``config.json`` | artifacts |

W&B and MLflow are the optional extra ``.[trackers]``; choosing one that is not installed fails before launch
(validation/settings.py ``check_trackers``). A resumed run starts a new W&B and MLflow run (TensorBoard, CSV and
metrics.jsonl continue their files).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

# the optional trackers, by logger flag: (module to import, the package to install)
OPTIONAL = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}


def missing_trackers(logger_cfg) -> list[str]:
    """The chosen optional trackers whose package is not installed."""
    return [name for name, (module, _) in OPTIONAL.items() if getattr(logger_cfg, name) and not _has(module)]


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists kept as values)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


class TensorBoardTracker:
    def __init__(self, run_dir: Path):
        from lightning_fabric.loggers import TensorBoardLogger

        self.logger = TensorBoardLogger(root_dir=str(run_dir), name="tensorboard", version="")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logger.log_metrics(metrics, step=step)

    def log_config(self, config: dict) -> None:
        import yaml

        self.logger.experiment.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log_image(self, tag: str, image_hwc: np.ndarray, step: int) -> None:
        self.logger.experiment.add_image(tag, image_hwc, step, dataformats="HWC")

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.logger.experiment.add_text(tag, text, step)

    def close(self) -> None:
        self.logger.finalize("success")


class CsvTracker:
    """Scalars only, one row per logged step (the config and samples are files of the run directory)."""

    def __init__(self, run_dir: Path):
        from lightning_fabric.loggers import CSVLogger

        self.logger = CSVLogger(root_dir=str(run_dir), name="csv", version="")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logger.log_metrics(metrics, step=step)
        self.logger.save()  # Fabric's CSVLogger buffers rows until save(): a crash keeps what was logged

    def log_config(self, config: dict) -> None:
        pass

    def log_image(self, tag: str, image_hwc: np.ndarray, step: int) -> None:
        pass

    def log_text(self, tag: str, text: str, step: int) -> None:
        pass

    def close(self) -> None:
        self.logger.finalize("success")


class WandbTracker:
    def __init__(self, run_dir: Path, logger_cfg, run_name: str):
        import wandb

        self.wandb = wandb
        settings = wandb.Settings(silent=True, x_disable_stats=True)
        self.run = wandb.init(
            project=logger_cfg.wandb_project,
            mode=logger_cfg.wandb_mode,
            dir=str(run_dir),
            name=run_name,
            settings=settings,
            reinit="create_new",
        )

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_config(self, config: dict) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_image(self, tag: str, image_hwc: np.ndarray, step: int) -> None:
        self.run.log({tag: self.wandb.Image(image_hwc)}, step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.run.log({tag: self.wandb.Table(columns=["text"], data=[[text]])}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, run_dir: Path, logger_cfg, run_name: str):
        import logging

        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its store's table migrations log at INFO
        uri = logger_cfg.mlflow_tracking_uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(logger_cfg.mlflow_experiment)
        if experiment is None:
            artifacts = None if logger_cfg.mlflow_tracking_uri else (run_dir / "mlflow_artifacts").resolve().as_uri()
            experiment_id = self.client.create_experiment(logger_cfg.mlflow_experiment, artifact_location=artifacts)
        else:
            experiment_id = experiment.experiment_id
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, step) for k, v in metrics.items()])

    def log_config(self, config: dict) -> None:
        from mlflow.entities import Param

        values = {k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in flatten(config).items()}
        params = [Param(k, v[:6000]) for k, v in values.items()]  # MLflow's length limit on a value
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.client.log_dict(self.run_id, config, "config.json")

    def log_image(self, tag: str, image_hwc: np.ndarray, step: int) -> None:
        self.client.log_image(self.run_id, image_hwc, f"{tag}/step_{step:08d}.png")

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.client.log_text(self.run_id, text, f"{tag}/step_{step:08d}.txt")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def build_trackers(run_dir: Path, logger_cfg) -> list:
    """The trackers ``logger_cfg`` turns on, for the run in ``run_dir``."""
    name = run_dir.resolve().name
    trackers: list = []
    if logger_cfg.tensorboard:
        trackers.append(TensorBoardTracker(run_dir))
    if logger_cfg.csv:
        trackers.append(CsvTracker(run_dir))
    if logger_cfg.wandb:
        trackers.append(WandbTracker(run_dir, logger_cfg, name))
    if logger_cfg.mlflow:
        trackers.append(MlflowTracker(run_dir, logger_cfg, name))
    return trackers
