"""Where tracking lives: MLflow's tracking URI and the local artifact folder.

Resolved once at the edge (CLI or flow entry) into a TrackingConfig; deep code takes that.
`MLFLOW_TRACKING_URI` wins; otherwise a SQLite file under INFERSMITH_HOME (./.infersmith). The
knowledge base lives under INFERSMITH_HOME in either case.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from tracking.errors import TrackingStoreError

# The experiment tag MLflow 3's UI reads to choose an experiment's first page: marked as model
# development, it opens on the runs table rather than on the GenAI overview of traces. (MLflow
# 3.17's UI follows its own GenAI / Model training switch instead: tracking/mlflow_ui.py.)
KIND_TAG, MODEL_DEVELOPMENT = "mlflow.experimentKind", "custom_model_development"


def home() -> Path:
    """The tracking home: INFERSMITH_HOME, or ./.infersmith."""
    return Path(os.environ.get("INFERSMITH_HOME", ".infersmith")).resolve()


@dataclass(frozen=True)
class TrackingConfig:
    uri: str
    artifact_root: str | None  # None: the tracking server decides

    @classmethod
    def from_env(cls) -> TrackingConfig:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            return cls(uri=uri, artifact_root=None)
        where = home()
        where.mkdir(parents=True, exist_ok=True)
        return cls(uri=f"sqlite:///{where / 'mlflow.db'}", artifact_root=(where / "artifacts").as_uri())


def _schema_revision_known(revision: str) -> bool:
    """Whether this MLflow has a migration to `revision`: a store at it is older than this MLflow."""
    versions = Path(mlflow.__file__).parent / "store" / "db_migrations" / "versions"
    return any(versions.glob(f"{revision}_*.py"))


def client(cfg: TrackingConfig) -> MlflowClient:
    # No mlflow.set_tracking_uri: it sets MLFLOW_TRACKING_URI in this process's environment, and
    # every later TrackingConfig.from_env() would then take the store for a server's and lose the
    # artifact folder.
    try:  # the client opens the store: a store from another MLflow fails here, in one line
        return MlflowClient(tracking_uri=cfg.uri)
    except mlflow.exceptions.MlflowException as e:
        found = re.search(r"found version (\w+), but expected (\w+)", str(e))
        if found is None:
            raise
        what = (f"the tracking store {cfg.uri} has database schema {found[1]}; this MLflow "
                f"({mlflow.__version__}) expects {found[2]}")
        if found[1] == "None":
            raise TrackingStoreError(f"{what}: it is no MLflow store (no schema revision)") from None
        if _schema_revision_known(found[1]):
            raise TrackingStoreError(
                f"{what}: an older MLflow wrote it. Open it with that version, or convert it once "
                "with `mlflow db upgrade URI` (the older MLflow cannot open it afterwards)") from None
        raise TrackingStoreError(
            f"{what}: a newer MLflow wrote it (for a GPU host's store: the host's wheels had a newer "
            "mlflow-skinny). Open it with that version; infra/controller_wheels.sh makes the host's "
            "wheels at this environment's version for the next run") from None


def experiment_id(c: MlflowClient, cfg: TrackingConfig, op: str) -> str:
    """One experiment per op: every run in it has the same metrics, so the UI compares them."""
    name = f"infersmith-{op}"
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if exp.tags.get(KIND_TAG) != MODEL_DEVELOPMENT:  # made before infersmith marked its experiments
            c.set_experiment_tag(exp.experiment_id, KIND_TAG, MODEL_DEVELOPMENT)
        return exp.experiment_id
    try:
        return c.create_experiment(name, artifact_location=cfg.artifact_root and f"{cfg.artifact_root}/{op}",
                                   tags={"infersmith.op": op, KIND_TAG: MODEL_DEVELOPMENT})
    except mlflow.exceptions.MlflowException as e:
        raced = c.get_experiment_by_name(name)  # another flow created it between our look and our create
        if raced is not None:
            return raced.experiment_id
        raise TrackingStoreError(f"cannot create the experiment {name} in the tracking store {cfg.uri}: "
                                 f"{e.message.splitlines()[0]}") from None
