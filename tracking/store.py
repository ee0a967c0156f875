"""Where tracking lives: MLflow's tracking URI and the local artifact folder.

Resolved once at the edge (CLI or flow entry) into a TrackingConfig; deep code takes that.
`MLFLOW_TRACKING_URI` wins; otherwise a SQLite file under INFERSMITH_HOME (./.infersmith).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from tracking.errors import TrackingStoreError


@dataclass(frozen=True)
class TrackingConfig:
    uri: str
    artifact_root: str | None  # None: the tracking server decides

    @classmethod
    def from_env(cls) -> TrackingConfig:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            return cls(uri=uri, artifact_root=None)
        home = Path(os.environ.get("INFERSMITH_HOME", ".infersmith")).resolve()
        home.mkdir(parents=True, exist_ok=True)
        return cls(uri=f"sqlite:///{home / 'mlflow.db'}", artifact_root=(home / "artifacts").as_uri())


def client(cfg: TrackingConfig) -> MlflowClient:
    mlflow.set_tracking_uri(cfg.uri)
    try:  # the client opens the store: a store from another MLflow fails here, in one line
        return MlflowClient(tracking_uri=cfg.uri)
    except mlflow.exceptions.MlflowException as e:
        found = re.search(r"found version (\w+), but expected (\w+)", str(e))
        if found is None:
            raise
        raise TrackingStoreError(
            f"the tracking store {cfg.uri} has database schema {found[1]}, this MLflow "
            f"({mlflow.__version__}) expects {found[2]}: another MLflow version wrote it. Open it "
            "with the version that wrote it (for a GPU host's store, make the host's wheels with "
            "infra/controller_wheels.sh from this environment, which pins this version), or convert "
            "it once with `mlflow db upgrade URI` (an older MLflow cannot open it afterwards)"
        ) from None


def experiment_id(c: MlflowClient, cfg: TrackingConfig, op: str) -> str:
    """One experiment per op: every run in it has the same metrics, so the UI compares them."""
    name = f"infersmith-{op}"
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(name, artifact_location=cfg.artifact_root and f"{cfg.artifact_root}/{op}",
                                   tags={"infersmith.op": op})
    except mlflow.exceptions.MlflowException:
        # Another flow created it between our look and our create.
        return c.get_experiment_by_name(name).experiment_id
