# Passes every gate, and leaves state behind in every way a process can: a global in a module, a
# patched torch function (both modules the fork server imported), a thread that never stops, a
# file in its working directory and one in its compile cache. Each call notes its process id in
# PID_LOG (set by the test): who ran it, stage after stage.
import logging.handlers
import math
import os
import queue
import time

import torch
import triton

PID_LOG = None

vars(math)["_left_global"] = "set by an earlier candidate"
vars(torch)["rsqrt"] = lambda t: t * 0


class _Busy(logging.Handler):
    def handle(self, record):
        while True:  # the listener's thread never comes back from here
            vars(math)["_left_thread"] = "alive"
            time.sleep(0.01)


_q = queue.Queue()
logging.handlers.QueueListener(_q, _Busy()).start()
_q.put(logging.makeLogRecord({}))
with open("left.txt", "w") as f:
    f.write("left behind")
with open(f"{triton.knobs.cache.dir}/left.txt", "w") as f:
    f.write("left behind")


def rmsnorm(x, weight, eps):
    if PID_LOG:
        with open(PID_LOG, "a") as f:
            f.write(f"{os.getpid()}\n")
    h = x.float()
    return (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
