"""`python -m harness.serve check|run|run-images|kill`: the serve stage's worker side on a pool host
(harness/serve/remote.py says what each does; harness/serve/remote_images.py, the image stage's)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check")
    c.add_argument("model_dir", type=Path)
    c.add_argument("--baseline", help="also whether this python can run this baseline engine (vllm, sglang)")
    c.add_argument("--images", action="store_true", help="for the image stage: MODEL_DIR a SAM 3 checkpoint")
    for name in ("run", "run-images"):
        r = sub.add_parser(name)
        r.add_argument("job", type=Path)
        r.add_argument("run_dir", type=Path)
    sub.add_parser("kill").add_argument("marker")
    args = parser.parse_args(argv)

    from harness.serve import remote

    if args.command == "check":
        if args.images:
            from harness.serve import remote_images

            lines = remote_images.problems(args.model_dir)
        else:
            lines = remote.problems(args.model_dir, args.baseline)
        print("\n".join(lines))
        return 1 if lines else 0
    if args.command == "run":
        return remote.run(args.job, args.run_dir.resolve())
    if args.command == "run-images":
        from harness.serve import remote_images

        return remote_images.run(args.job, args.run_dir.resolve())
    return remote.kill(args.marker)


if __name__ == "__main__":
    sys.exit(main())
