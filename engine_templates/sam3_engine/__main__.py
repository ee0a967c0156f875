"""`python -m engine_templates.sam3_engine serve | serve-reference` (a random model directory to serve:
`python -m engine_templates.engine random-checkpoint --preset sam3-tiny`)."""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_templates.sam3_engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("serve", "serve-reference"):
        s = sub.add_parser(name)
        s.add_argument("--model-dir", type=Path, required=True)
        s.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16" if name == "serve" else "fp32")
        s.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
        s.add_argument("--host", default="127.0.0.1")
        s.add_argument("--port", type=int, default=8000)
        s.add_argument("--served-model-name", default=None)
        if name == "serve":
            s.add_argument("--kernels", type=Path, help="a kernels file (ops.py says its format)")
            s.add_argument("--max-batch-images", type=int, default=32)
            s.add_argument("--prompt-cache", type=int, default=1024, help="prompts whose text embeddings are kept")
            s.add_argument("--cuda-graph-batch-sizes", default="1,2,4,8,16,32")
            s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except _UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


class _UsageError(Exception):
    pass


def _run(args) -> int:
    import torch

    from engine_templates.engine.config import EngineSetupError
    from engine_templates.engine.server import check_listen
    from engine_templates.sam3_engine import server

    if not (args.model_dir / "config.json").is_file() or not (args.model_dir / "tokenizer.json").is_file():
        raise _UsageError(f"not a SAM 3 model directory: {args.model_dir} needs config.json and tokenizer.json")
    from engine_templates.hf_config import ConfigError
    from engine_templates.vision import sam3_dims

    try:
        sam3_dims(str(args.model_dir))  # the vision target's reader: a language model's config is one line
    except ConfigError as e:
        raise _UsageError(str(e)) from None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = args.served_model_name or args.model_dir.name
    try:
        check_listen(args.host, args.port)
        if args.command == "serve-reference":
            runner, kind = server.ReferenceRunner(args.model_dir, args.dtype, device), "reference"
        else:
            from engine_templates.sam3_engine.model import Sam3Engine
            from engine_templates.sam3_engine.ops import Sam3Kernels

            try:
                sizes = [] if args.enforce_eager else [int(b) for b in args.cuda_graph_batch_sizes.split(",") if b]
            except ValueError:
                raise _UsageError("--cuda-graph-batch-sizes: a comma-separated list of integers") from None
            engine = Sam3Engine(args.model_dir, args.dtype, device, Sam3Kernels.from_file(args.kernels),
                                args.prompt_cache, sizes)
            runner, kind = server.Batcher(engine, args.max_batch_images), "engine"
        asyncio.run(server.serve(runner, name, kind, args.host, args.port))
    except EngineSetupError as e:
        raise _UsageError(str(e)) from None
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
