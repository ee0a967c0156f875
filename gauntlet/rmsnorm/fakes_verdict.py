# expect: crash process — writes a passing verdict where the harness writes its own, then exits
# quietly (names computed to reach the runtime): the supervisor writes the verdict last.
import json
import os

for path in ("verdict.json", os.path.join("..", "verdict.json")):
    with open(path, "w") as f:
        json.dump({"op": "rmsnorm", "candidate_id": "x", "status": "pass", "gates": []}, f)
getattr(os, "_ex" + "it")(0)


def rmsnorm(x, weight, eps):
    return x.clone()
