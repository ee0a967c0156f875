"""Reports as the sandbox writes them (harness/channel.py), for the tests that feed the judge a
whole report at once: each frame a JSON header line, its tensors' bytes in a staging buffer of
the test's own (`REPORT`), each at a place of its own — a report read whole has no `taken`
between its frames, so no place is used twice."""
from __future__ import annotations

import json
import os

import torch

from harness.channel import ALIGN, Staging


class Report:
    def __init__(self, size: int = 64 << 20):
        self.staging = Staging(os.memfd_create("test-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING), size)
        self.at = 0

    def frame(self, kind: str, tensors=(), **fields) -> bytes:
        """A frame as harness.channel.Sender writes it, its tensors' bytes put in the buffer."""
        metas, offsets, sizes = [], [], []
        for t in tensors:
            flat = t.contiguous().reshape(-1).view(torch.uint8)
            if self.at + flat.numel() > self.staging.size:
                self.at = 0
            self.staging.view[self.at:self.at + flat.numel()].copy_(flat)
            metas.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)})
            offsets.append(self.at)
            sizes.append(flat.numel())
            self.at += -(-flat.numel() // ALIGN) * ALIGN
        header = {"kind": kind, "tensors": metas, "offsets": offsets, "nbytes": sizes, **fields}
        return json.dumps(header).encode() + b"\n"


REPORT = Report()
