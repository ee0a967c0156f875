"""The report channel from the sandboxed candidate process to the supervisor, and the staging
buffer its outputs cross in.

Frames are a JSON header line, never pickle, so nothing the candidate's process sends can run
code in the supervisor. An output's bytes do not travel in the frame: the sandbox copies them
into the staging buffer (`Staging`: shared memory the supervisor makes before the sandbox
starts, sized and sealed before the sandbox's first request, pinned for DMA on a GPU host) and
the frame says where
they lie (offset, byte count, dtype, shape). The supervisor copies each output out of the buffer
into memory of its own, on the oracle's device, before anything else reads it, and only then
answers `taken` (the sandbox reuses the buffer for its next output once it has that answer):
the judge checks the copy alone, so bytes changed in the buffer afterwards, by the candidate or
anyone, change nothing it decides. The supervisor trusts a frame only as far as it can check
it: outputs are judged against its own oracle; a frame that is malformed, points outside the
buffer, lies about its sizes or arrives with no buffer is a protocol violation, recorded as such.
"""
from __future__ import annotations

import fcntl
import json
import mmap
import os
from typing import Any, BinaryIO

import torch

MAX_HEADER = 1 << 20
# Where each output starts in the staging buffer: a multiple of this, so that every dtype's
# view of it is aligned (and a GPU's copy of it starts on a cache line).
ALIGN = 64


class ProtocolError(Exception):
    """The sandbox sent something that is not a well-formed frame."""


class CutOff(ProtocolError):
    """The stream ended inside a frame: the writer died (or was killed) while sending it."""


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ProtocolError(f"unknown dtype {name!r}")
    return dt


def staging_size(largest: int, n_outputs: int) -> int:
    """The staging buffer for outputs of at most `largest` bytes in all, `n_outputs` of them a
    call: each output starts aligned (ALIGN), and the whole is a number of pages."""
    need = largest + n_outputs * ALIGN
    return max(mmap.PAGESIZE, -(-need // mmap.PAGESIZE) * mmap.PAGESIZE)


class Pins:
    """The leading bytes of a staging buffer's mapping in this process, page-locked for CUDA (a
    device's copy to or from them is DMA), grown as larger outputs come: the buffer is sized by a
    bound on a call's outputs, and only what outputs use is pinned (pinning holds the pages)."""

    def __init__(self, view: torch.Tensor):
        self.view, self.bytes, self.failed = view, 0, ""

    def cover(self, n: int) -> None:
        """At least the first `n` bytes pinned (a failure is kept, and the copies go unpinned)."""
        if n <= self.bytes or self.failed:
            return
        want = min(self.view.numel(), max(2 * self.bytes, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE))
        try:
            rt = torch.cuda.cudart()
            if self.bytes:
                rt.cudaHostUnregister(self.view.data_ptr())
            err = rt.cudaHostRegister(self.view.data_ptr(), want, 0)
        except (AttributeError, RuntimeError, AssertionError) as e:
            self.bytes, self.failed = 0, f"{type(e).__name__}: {e}"[:200]
            return
        if err != rt.cudaError.success:
            self.bytes, self.failed = 0, f"cudaHostRegister: {err}"
            return
        self.bytes = want

    def describe(self) -> str:
        return f"not pinned ({self.failed})" if self.failed else f"its first {self.bytes} bytes pinned"


class Staging:
    """The supervisor's end of the staging buffer: the anonymous shared-memory file (memfd) `fd`,
    made before the sandbox started so that it inherited it, here given its `size` and sealed
    against shrinking and growing before the sandbox runs anything but the harness (its first
    request comes after this), so that no process can cut the pages from under this one's copies
    (a read past a file's end is a SIGBUS). The sandbox maps it (`Stager`)."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self._map = mmap.mmap(fd, size)
        self.view = torch.frombuffer(self._map, dtype=torch.uint8)  # only ever copied from
        self.pins: Pins | None = None  # on a GPU host, once this process has its CUDA context: `pin`

    def pin(self) -> None:
        """Page-lock what outputs use, from now on, for this process's GPU copies."""
        if self.pins is None:
            self.pins = Pins(self.view)

    def take(self, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int], device: str) -> torch.Tensor:
        """The bytes at [offset, offset + nbytes), copied into a tensor of this process's own on
        `device` (one copy; from pinned memory to a GPU, DMA), as `dtype` of `shape`."""
        if nbytes and self.pins is not None and device != "cpu":
            self.pins.cover(offset + nbytes)
        snap = torch.empty(nbytes, dtype=torch.uint8, device=device)
        snap.copy_(self.view[offset:offset + nbytes])  # synchronous: the copy is done on return
        return snap.view(dtype).reshape(shape)

    def describe(self) -> str:
        return f"{self.size} bytes of shared memory, sealed" + (f"; {self.pins.describe()}" if self.pins else "")


class Stager:
    """The sandbox's end of the staging buffer: the descriptor it inherited, mapped."""

    def __init__(self, fd: int, device: str = "cpu"):
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size)
        self.view = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pins = Pins(self.view) if device == "cuda" else None

    def put(self, tensors: tuple[torch.Tensor, ...]) -> list[dict]:
        """Each tensor's bytes copied into the buffer, one after another from its start (a device
        tensor's straight from the device); where each lies, as a frame says it."""
        flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        starts, at = [], 0
        for f in flats:
            starts.append(at)
            at += -(-f.numel() // ALIGN) * ALIGN
        if at > self.view.numel():
            raise ValueError(f"outputs of {at} bytes do not fit the {self.view.numel()}-byte staging buffer")
        if self.pins is not None:
            self.pins.cover(at)
        for start, flat in zip(starts, flats):
            self.view[start:start + flat.numel()].copy_(flat)  # from a device: DMA into pinned memory
        return [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": start,
                 "nbytes": f.numel()} for t, f, start in zip(tensors, flats, starts)]


class Sender:
    """The sandbox's end of the channel: one file descriptor inherited from the supervisor, and
    the staging buffer (`Stager`) outputs cross in."""

    def __init__(self, fd: int, stager: Stager | None = None):
        self._f = os.fdopen(fd, "wb", buffering=0)
        self.stager = stager

    def send(self, kind: str, tensors: tuple[torch.Tensor, ...] = (), **fields: Any) -> None:
        """One frame; its tensors' bytes in the staging buffer first. A frame with tensors is
        followed by the supervisor's `taken`, which the caller waits for before it sends again."""
        metas = self.stager.put(tuple(tensors)) if tensors else []
        header = json.dumps({"kind": kind, "tensors": [{"dtype": m["dtype"], "shape": m["shape"]} for m in metas],
                             "offsets": [m["offset"] for m in metas], "nbytes": [m["nbytes"] for m in metas],
                             **fields})
        data = memoryview(header.encode() + b"\n")
        while data.nbytes:  # an unbuffered write may take less than all
            data = data[self._f.write(data):]


def read_frame(stream: BinaryIO, staging: Staging | None, device: str = "cpu") -> tuple[dict, list[torch.Tensor]] | None:
    """The next frame, its tensors copied out of `staging` onto `device` (this process's own
    memory); None at end of stream; ProtocolError when it is not a frame."""
    line = stream.readline(MAX_HEADER)
    if not line:
        return None
    if not line.endswith(b"\n"):
        if len(line) < MAX_HEADER:
            raise CutOff("header line cut off")
        raise ProtocolError("header line too long")
    try:
        header = json.loads(line)
        metas, sizes, offsets = header["tensors"], header["nbytes"], header.get("offsets", [])
        assert isinstance(header["kind"], str) and isinstance(metas, list) and isinstance(sizes, list)
        assert isinstance(offsets, list) and len(offsets) == len(metas)
        assert len(metas) == len(sizes) and all(type(n) is int and n >= 0 for n in sizes)
        assert all(type(n) is int and n >= 0 for n in offsets)
        assert all(isinstance(m, dict) and isinstance(m.get("dtype"), str) and isinstance(m.get("shape"), list)
                   and all(type(d) is int and d >= 0 for d in m["shape"]) for m in metas)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise ProtocolError(f"malformed header: {line[:200]!r}") from None
    if not metas:
        return header, []
    if staging is None:
        raise ProtocolError("tensors, and no staging buffer to find them in")
    regions = []
    for meta, offset, size in zip(metas, offsets, sizes):
        dtype, shape = _dtype(meta["dtype"]), meta["shape"]
        numel = 1
        for d in shape:
            numel *= d
        if size != numel * dtype.itemsize:
            raise ProtocolError(f"{size} bytes for shape {shape} of {meta['dtype']}, which takes "
                                f"{numel * dtype.itemsize}")
        if offset + size > staging.size:
            raise ProtocolError(f"bytes {offset} to {offset + size} past the end of the {staging.size}-byte "
                                "staging buffer")
        regions.append((offset, size, dtype, shape))
    spans = sorted((o, o + n) for o, n, _, _ in regions if n)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise ProtocolError(f"outputs overlap in the staging buffer (one ends at {end}, the next starts at "
                                f"{start})")
    return header, [staging.take(o, n, dt, shape, device) for o, n, dt, shape in regions]


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
