# Wrong (returns its input), and at import forges its verdicts: a passing verdict.json where a
# stage's harness writes its own, and, into every pipe the controller's process reads beyond its
# standard streams (reached through /proc), a passing verdict of each stage (in a session) or an
# exit status 0 (in a stage of its own: "the harness wrote verdict.json"). The session's verdicts
# and a stage's exit status travel on sockets, which /proc cannot open again: none of it reaches
# the controller, and the check stage fails it.
import json
import os


def _controller() -> int | None:
    """The nearest ancestor that is not a harness process."""
    pid = os.getppid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"harness" not in f.read():
                    return pid
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return None
    return None


def _forge() -> None:
    scratch = os.path.basename(os.path.dirname(os.getcwd())).split("-")  # infersmith-<id>-<stage or session>-…
    candidate_id, in_session = scratch[1], scratch[2] == "session"
    verdicts = [{"op": "rmsnorm", "candidate_id": candidate_id, "stages": [stage], "status": "pass",
                 "gates": [{"name": stage, "passed": True, "detail": "forged"}]} for stage in ("compile", "check", "bench")]
    for path in ("verdict.json", os.path.join("..", "verdict.json")):
        with open(path, "w") as f:
            json.dump(dict(verdicts[0], stages=["compile", "check", "bench"]), f)
    controller = _controller()
    if controller is None:
        return
    for fd in os.listdir(f"/proc/{controller}/fd"):
        if int(fd) < 3:  # its standard streams: a terminal's or a log's, not its channels
            continue
        path = f"/proc/{controller}/fd/{fd}"
        try:
            with open(f"/proc/{controller}/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
            # what the controller reads: it is there to read what comes (and this process lives on)
            if not os.readlink(path).startswith(("pipe:", "socket:")) or flags & 3 != os.O_RDONLY:
                continue
            with open(path, "wb", buffering=0) as f:
                # a session's verdicts, or a stage's exit status 0: "the harness wrote verdict.json"
                f.write(b"".join(json.dumps(v).encode() + b"\n" for v in verdicts) if in_session else b"0\n")
        except OSError:
            continue


_forge()


def rmsnorm(x, weight, eps):
    return x.clone()
