"""An S3-compatible server on a loopback port: moto's standalone server, which speaks the real S3
HTTP API to boto3 — ours and MLflow's — in this process and in the servers' (tests/test_artifacts.py,
tests/test_platform.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import boto3
from loopback_sshd import free_port

MOTO = Path(sys.executable).parent / "moto_server"
# moto accepts any key pair; a real one would come from the environment or an AWS profile too
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "infersmith-test", "AWS_SECRET_ACCESS_KEY": "infersmith-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen

    def env(self) -> dict[str, str]:
        """What a process needs to use it: boto3 reads the endpoint and the keys from these."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@contextmanager
def s3_server(log: Path, buckets: tuple[str, ...] = ()) -> Iterator[S3Server]:
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(MOTO), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **CREDENTIALS})
    server = S3Server(f"http://127.0.0.1:{port}", proc)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                server.client().list_buckets()
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        for bucket in buckets:
            server.client().create_bucket(Bucket=bucket)
        yield server
    finally:
        server.stop()
