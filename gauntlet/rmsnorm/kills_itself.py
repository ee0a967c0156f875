# expect: crash process — kills its own process (a segfault in an extension looks the same);
# the name is computed so that static screening lets it through to the runtime gate.
import os


def rmsnorm(x, weight, eps):
    getattr(os, "ki" + "ll")(os.getpid(), 9)
