# expect: crash process — kills its own process (a segfault in an extension looks the same).
import os


def rmsnorm(x, weight, eps):
    os._exit(139)
