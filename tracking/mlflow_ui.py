"""Links into MLflow's UI, for people: the op's runs, and the comparison of an optimization's best
candidates.

MLflow's compare view (`#/compare-runs?runs=[...]&experiments=[...]`, the route its UI builds
itself) shows the runs' metrics side by side: per shape the candidate's time, its baselines'
(`<shape>/eager_us`, `<shape>/compile_us`), its speed-ups over them and its % of roofline, then
its GPU-hours, dollars and the proposer's tokens. Every link asks for the UI's model-training
pages (`workflowType=machine_learning`): MLflow 3.17 follows that switch, not the experiment's
kind, and opens an experiment on its GenAI overview without it. With a tracking server the UI is
the server's own address; with the embedded store it is what `mlflow ui --backend-store-uri
sqlite:///...` serves, http://127.0.0.1:5000 unless INFERSMITH_MLFLOW_UI names another address.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING
from urllib.parse import quote

if TYPE_CHECKING:
    from tracking.store import TrackingConfig

LOCAL_UI = "http://127.0.0.1:5000"
COMPARED = 5  # best candidates in a comparison link
TRAINING = "workflowType=machine_learning"  # the UI's "Model training" side: runs tables, not traces


def ui_url(cfg: TrackingConfig) -> str:
    if cfg.uri.startswith(("http://", "https://")):
        return cfg.uri.rstrip("/")
    return os.environ.get("INFERSMITH_MLFLOW_UI", LOCAL_UI).rstrip("/")


def experiments_url(ui: str) -> str:
    """The UI's list of experiments, on its model-training side."""
    return f"{ui.rstrip('/')}/#/experiments?{TRAINING}"


def compare_url(cfg: TrackingConfig, experiment_id: str, run_ids: list[str]) -> str:
    """MLflow's comparison of these runs of one experiment."""
    def arg(ids: list[str]) -> str:
        return quote(json.dumps(ids, separators=(",", ":")), safe="")

    return f"{ui_url(cfg)}/#/compare-runs?runs={arg(run_ids)}&experiments={arg([experiment_id])}&{TRAINING}"


def compare_best(cfg: TrackingConfig, experiment_id: str, run_ids: list[str]) -> str:
    """MLflow's comparison of the first COMPARED of these runs (best first), or "" for no runs."""
    return compare_url(cfg, experiment_id, run_ids[:COMPARED]) if run_ids else ""
