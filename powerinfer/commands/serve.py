"""`powerinfer serve`: the OpenAI-compatible HTTP API on loopback by default."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import BadArgumentError
from .common import add_engine_arguments, add_model_arguments, load_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-concurrency", type=int, default=1, help="generations running at once (default 1)")
    p.add_argument("--queue-size", type=int, default=16, help="requests waiting beyond those (default 16); then 429")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--model-name", default=None, help="model id clients use (default: the file or directory name)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..engine.generate import warm_up
    from ..server import Server, create_app

    if args.max_concurrency < 1 or args.queue_size < 0 or not 0 < args.port < 65536:
        raise BadArgumentError("need --max-concurrency >= 1, --queue-size >= 0 and a port in 1..65535")
    lm = load_from_args(args)
    warm_up(lm.model)  # so that the first request does not pay for loading the kernels
    name = args.model_name or os.path.basename(lm.path.rstrip("/"))
    server = Server(lm, name, args.max_concurrency, args.queue_size, args.api_key)
    print(f"serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="warning")
    return 0
