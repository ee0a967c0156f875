"""What the project uploads itself goes to S3 through boto3: each optimization's results archive.

Run artifacts (candidate sources, verdicts, transcripts, AIPerf exports, charts) are MLflow's to
send: to the tracking server's artifact root, S3 when the server has one. Besides those, a flow
whose INFERSMITH_S3_URI names a bucket (s3://bucket/prefix) writes one archive of its results
under INFERSMITH_HOME/results/ and sends it there, through object_store/s3.py (whose errors name
the bucket and the endpoint, never a credential). A bucket that cannot be reached fails the flow
before its first candidate; an upload that fails at the end fails it saying where the archive was
kept.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

from object_store import ObjectStoreError, store_from_env


def _home() -> Path:
    return Path(os.environ.get("INFERSMITH_HOME", ".infersmith")).resolve()


class Results:
    """A flow's results archive: opened when the flow starts (S3 checked then), published when it ends."""

    def __init__(self, experiment: str):
        self.experiment = experiment
        self.store = store_from_env()
        if self.store is not None:
            self.store.check()

    def publish(self, run_id: str, files: dict[str, object]) -> str | None:
        """With S3 configured: `files` (name -> JSON-able or text) as results/<experiment>/<run_id>.tar.gz
        under the tracking home, sent to S3; its S3 URI. Without: nothing (None)."""
        if self.store is None:
            return None
        path = _home() / "results" / self.experiment / f"{run_id}.tar.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(path, "w:gz") as tar:
            for name, obj in files.items():
                data = (obj if isinstance(obj, str) else json.dumps(obj, indent=1, default=str)).encode()
                info = tarfile.TarInfo(f"{run_id}/{name}")
                info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
                tar.addfile(info, io.BytesIO(data))
        try:
            return self.store.put(path, f"results/{self.experiment}/{path.name}")
        except ObjectStoreError as e:
            raise ObjectStoreError(f"{e}; the results are kept at {path}") from None
