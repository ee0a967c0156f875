"""What the project uploads itself goes to S3 through boto3: each optimization's results archive.

Run artifacts (candidate sources, verdicts, transcripts, AIPerf exports, charts) are MLflow's to
send: to the tracking server's artifact root, S3 when the server has one. Besides those, a flow
whose INFERSMITH_S3_URI names a bucket (s3://bucket/prefix) writes one archive of its results
under INFERSMITH_HOME/results/ and sends it there.

boto3 finds the credentials itself (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an
instance role) and an S3-compatible store's address in AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL.
Errors name the bucket and the endpoint, never a credential. A bucket that cannot be reached
fails the flow before its first candidate; an upload that fails at the end fails it saying where
the archive was kept.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import boto3
from boto3.exceptions import S3UploadFailedError
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from tracking.errors import ArtifactStoreError

S3_URI_VAR = "INFERSMITH_S3_URI"


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or "a/b", no slashes at either end

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        if not uri.startswith("s3://") or not uri[5:].split("/", 1)[0]:
            raise ValueError(f"not an S3 URI (s3://bucket[/prefix]): {uri!r}")
        bucket, _, prefix = uri[5:].partition("/")
        return cls(bucket, prefix.strip("/"))

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def uri(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{self.key(name)}" if name else f"s3://{self.bucket}/{self.prefix}".rstrip("/")


class S3Store:
    """One bucket (and prefix) through boto3: few retries and short timeouts, so that a store that
    does not answer is a failed run within a minute, not a hung one."""

    def __init__(self, location: S3Location):
        self.location = location
        self.client = boto3.client("s3", config=Config(retries={"max_attempts": 3, "mode": "standard"},
                                                       connect_timeout=5, read_timeout=30))

    @classmethod
    def from_env(cls) -> S3Store | None:
        uri = os.environ.get(S3_URI_VAR)
        if not uri:
            return None
        try:
            return cls(S3Location.parse(uri))
        except ValueError as e:
            raise ArtifactStoreError(f"{S3_URI_VAR}: {e}") from None

    def _error(self, what: str, e: Exception) -> ArtifactStoreError:
        reason = (e.response.get("Error", {}).get("Message") or str(e)) if isinstance(e, ClientError) else str(e)
        return ArtifactStoreError(f"S3 unreachable: {what} bucket {self.location.bucket} at "
                                  f"{self.client.meta.endpoint_url}: {reason.splitlines()[0] if reason else type(e).__name__}")

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.location.bucket)
        except (BotoCoreError, ClientError) as e:
            raise self._error("cannot reach", e) from None

    def put(self, path: Path, name: str) -> str:
        try:
            self.client.upload_file(str(path), self.location.bucket, self.location.key(name))
        except (BotoCoreError, ClientError, S3UploadFailedError) as e:
            raise self._error(f"cannot upload {name} to", e) from None
        return self.location.uri(name)

    def read(self, name: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.location.bucket, Key=self.location.key(name))["Body"].read()
        except (BotoCoreError, ClientError) as e:
            raise self._error(f"cannot read {name} from", e) from None


def _home() -> Path:
    return Path(os.environ.get("INFERSMITH_HOME", ".infersmith")).resolve()


class Results:
    """A flow's results archive: opened when the flow starts (S3 checked then), published when it ends."""

    def __init__(self, experiment: str):
        self.experiment = experiment
        self.store = S3Store.from_env()
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
        except ArtifactStoreError as e:
            raise ArtifactStoreError(f"{e}; the results are kept at {path}") from None
