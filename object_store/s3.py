"""One bucket (and prefix) through boto3.

boto3 finds the credentials itself (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an
instance role) and an S3-compatible store's address in AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL.
Errors name the bucket and the endpoint, never a credential.
"""
from __future__ import annotations

import os
from pathlib import Path

import boto3
from boto3.exceptions import S3UploadFailedError
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from object_store import S3_URI_VAR, ObjectStoreError, S3Location


class S3Store:
    """Few retries and short timeouts, so that a store that does not answer is a failed run within a
    minute, not a hung one."""

    def __init__(self, location: S3Location):
        self.location = location
        # a session of its own: boto3's default session is not safe to share between threads
        config = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=30)
        self.client = boto3.session.Session().client("s3", config=config)

    @classmethod
    def from_env(cls) -> S3Store | None:
        """The store INFERSMITH_S3_URI names; None when it is unset."""
        uri = os.environ.get(S3_URI_VAR)
        if not uri:
            return None
        try:
            return cls(S3Location.parse(uri))
        except ValueError as e:
            raise ObjectStoreError(f"{S3_URI_VAR}: {e}") from None

    @property
    def where(self) -> str:
        """The bucket and the endpoint, for messages."""
        return f"bucket {self.location.bucket} at {self.client.meta.endpoint_url}"

    def _error(self, what: str, e: Exception) -> ObjectStoreError:
        reason = (e.response.get("Error", {}).get("Message") or str(e)) if isinstance(e, ClientError) else str(e)
        return ObjectStoreError(f"S3 unreachable: {what} {self.where}: "
                                f"{reason.splitlines()[0] if reason else type(e).__name__}")

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

    def put_once(self, data: bytes, name: str) -> bool:
        """`data` as `name` unless an object of that name exists (the name is a digest of the data);
        whether it was sent."""
        key = self.location.key(name)
        try:
            self.client.head_object(Bucket=self.location.bucket, Key=key)
            return False
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                raise self._error(f"cannot look for {name} in", e) from None
        except BotoCoreError as e:
            raise self._error(f"cannot look for {name} in", e) from None
        try:
            self.client.put_object(Bucket=self.location.bucket, Key=key, Body=data)
        except (BotoCoreError, ClientError) as e:
            raise self._error(f"cannot upload {name} to", e) from None
        return True

    def presigned_get(self, name: str, expires_s: int) -> str:
        """A URL that reads `name` without credentials for `expires_s` seconds. It is a secret while it
        lasts: pass it on a process's stdin, never in argv, a file or a log."""
        try:
            return self.client.generate_presigned_url("get_object", ExpiresIn=expires_s,
                                                      Params={"Bucket": self.location.bucket,
                                                              "Key": self.location.key(name)})
        except (BotoCoreError, ClientError) as e:
            raise self._error(f"cannot sign a link to {name} in", e) from None
