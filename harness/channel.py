"""The one-way report channel from the sandboxed candidate process to the supervisor.

Frames are a JSON header line and raw tensor bytes — never pickle, so nothing the
candidate's process sends can run code in the supervisor. The supervisor trusts a frame
only as far as it can check it: outputs are judged against its own oracle; a frame that
is malformed or oversized is a protocol violation, recorded as such.
"""
from __future__ import annotations

import json
import os
from typing import Any, BinaryIO

import torch

MAX_HEADER = 1 << 20


class ProtocolError(Exception):
    """The sandbox sent something that is not a well-formed frame."""


class CutOff(ProtocolError):
    """The stream ended inside a frame: the writer died (or was killed) while sending it."""


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ProtocolError(f"unknown dtype {name!r}")
    return dt


class Sender:
    """The sandbox's end: one file descriptor inherited from the supervisor."""

    def __init__(self, fd: int):
        self._f = os.fdopen(fd, "wb", buffering=0)

    def send(self, kind: str, tensors: tuple[torch.Tensor, ...] = (), **fields: Any) -> None:
        # Each tensor's bytes as they lie in host memory (a device tensor copied there first),
        # written from that memory without a further copy.
        blobs = [memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
                 for t in tensors]
        meta = [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for t in tensors]
        header = json.dumps({"kind": kind, "tensors": meta, "nbytes": [b.nbytes for b in blobs], **fields})
        self._f.write(header.encode() + b"\n")
        for b in blobs:
            while b.nbytes:  # an unbuffered write may take less than all
                b = b[self._f.write(b):]


def read_frame(stream: BinaryIO, max_payload: int) -> tuple[dict, list[torch.Tensor]] | None:
    """The next frame, or None at end of stream; ProtocolError when it is not a frame."""
    line = stream.readline(MAX_HEADER)
    if not line:
        return None
    if not line.endswith(b"\n"):
        if len(line) < MAX_HEADER:
            raise CutOff("header line cut off")
        raise ProtocolError("header line too long")
    try:
        header = json.loads(line)
        metas, sizes = header["tensors"], header["nbytes"]
        assert isinstance(header["kind"], str) and isinstance(metas, list) and isinstance(sizes, list)
        assert len(metas) == len(sizes) and all(type(n) is int and n >= 0 for n in sizes)
        assert all(isinstance(m, dict) and isinstance(m.get("dtype"), str) and isinstance(m.get("shape"), list)
                   and all(type(d) is int and d >= 0 for d in m["shape"]) for m in metas)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise ProtocolError(f"malformed header: {line[:200]!r}") from None
    if sum(sizes) > max_payload:
        raise ProtocolError(f"payload of {sum(sizes)} bytes exceeds the {max_payload} this frame may carry")
    tensors = []
    for meta, size in zip(metas, sizes):
        data = _read_exactly(stream, size)
        dtype, shape = _dtype(meta["dtype"]), meta["shape"]
        t = torch.frombuffer(data, dtype=dtype) if size else torch.empty(0, dtype=dtype)
        try:
            tensors.append(t.reshape(shape))
        except RuntimeError as e:
            raise ProtocolError(f"payload does not fit shape {shape}: {e}") from None
    return header, tensors


def _read_exactly(stream: BinaryIO, size: int) -> bytearray:
    """`size` bytes read straight into the buffer the tensor is made of (no copy of a copy);
    CutOff when the stream ends first."""
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = stream.readinto(view[got:])
        if not n:
            raise CutOff("stream ended inside a payload")
        got += n
    return data


# -- what the judge checks of a frame's fields --------------------------------------------------
def brief(header: dict) -> str:
    return json.dumps(header, default=str)[:200]


def is_number(x: object) -> bool:
    return type(x) in (int, float)


def check_timing(header: dict) -> None:
    """A timing frame has the fields the sandbox writes, of the types it writes them in."""
    dims = header.get("dims")
    ok = (isinstance(dims, dict) and all(isinstance(k, str) and type(n) is int for k, n in dims.items())
          and all(is_number(header.get(k)) for k in ("candidate_us", "candidate_us_repeat"))
          and isinstance(header.get("method"), str)
          and type(header.get("sets")) is int and type(header.get("graph_outputs")) is int
          and isinstance(header.get("reps", []), list) and all(type(n) is int for n in header.get("reps", []))
          and isinstance(header.get("steady", []), list) and all(type(b) is bool for b in header.get("steady", [])))
    if not ok:
        raise ProtocolError(f"a timing frame {brief(header)}")


def item_index(text: str) -> int:
    """An index as the sandbox writes it: each output has one name (no -1 for the last, no 01)."""
    n = int(text)
    if n < 0 or str(n) != text:
        raise ValueError(text)
    return n
