"""The S3 bucket (and prefix) that infersmith uploads its own files to: where it is, and its errors.

Both `tracking/` (each optimization's results archive) and `gpu_pool/` (the worker bundle a pool
host fetches) send there; `object_store/s3.py` is the boto3 client they share. This module imports
the standard library only, so that the CLI can name the error before it loads boto3.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from object_store.s3 import S3Store

S3_URI_VAR = "INFERSMITH_S3_URI"


class ObjectStoreError(Exception):
    """S3 cannot be used: one line naming the bucket, the endpoint and why, never a credential."""


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


def store_from_env() -> S3Store | None:
    """The store INFERSMITH_S3_URI names, or None when it is unset: then boto3 is not even imported
    (a second or so of every command's start, and a host that never uploads need not have it)."""
    if not os.environ.get(S3_URI_VAR):
        return None
    from object_store.s3 import S3Store

    return S3Store.from_env()
