"""The worker-side bundle: contract/, harness/ and engine_templates/ as one content-addressed tarball.

The same sources always give the same bytes (sorted entries, no timestamps, no owners),
so the digest names the bundle and a host that already has it is not sent it again.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from gpu_pool.local import WORKER_ROOT

WORKER_PACKAGES = ("contract", "harness", "engine_templates")


@dataclass(frozen=True)
class Bundle:
    digest: str  # sha256 of the tarball, first 16 hex digits
    tarball: bytes
    sha256: str  # all of it, checked by a host that fetches the tarball from S3


def _files(root: Path):
    for package in WORKER_PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                yield path


def build_bundle(root: Path = WORKER_ROOT) -> Bundle:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _files(root):
            data = path.read_bytes()
            info = tarfile.TarInfo(str(path.relative_to(root)))
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    tarball = gzip.compress(raw.getvalue(), mtime=0)
    sha256 = hashlib.sha256(tarball).hexdigest()
    return Bundle(sha256[:16], tarball, sha256)


@lru_cache(maxsize=1)
def _cached(stamp: tuple) -> Bundle:
    return build_bundle()


def current_bundle() -> Bundle:
    """The bundle of the sources as they are now; rebuilt only when a file changed."""
    stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in _files(WORKER_ROOT))
    return _cached(stamp)


def unpack(bundle: Bundle, root: Path) -> Path:
    """The bundle extracted under `root`, its bytecode compiled by this interpreter: a worker
    root (LocalExecutor(worker_root=...)) whose first imports write nothing under harness/, so
    that stages running side by side never see each other's compiles as writes."""
    import compileall

    with tarfile.open(fileobj=io.BytesIO(bundle.tarball), mode="r:gz") as tar:
        tar.extractall(root, filter="data")
    for package in WORKER_PACKAGES:
        compileall.compile_dir(root / package, quiet=2)
    return root

