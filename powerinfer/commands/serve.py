"""`powerinfer serve`: the OpenAI-compatible HTTP API on loopback by default."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading

from ..engine.batch import PREFILL_CHUNK
from ..errors import BadArgumentError
from ..paths import looks_like_hub_id
from .common import add_engine_arguments, add_model_arguments, load_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=None,
                   help="sequences decoded together per step (default: what the memory for their KV caches allows, "
                        "at most 8)")
    p.add_argument("--max-concurrency", type=int, default=None, dest="max_concurrency", help=argparse.SUPPRESS)
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help=f"prompt tokens per engine step: a long prompt delays the others' next token by one chunk "
                        f"(default {PREFILL_CHUNK})")
    p.add_argument("--queue-size", type=int, default=16, help="requests waiting beyond those (default 16); then 429")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--model-name", default=None, help="model id clients use (default: the file or directory name)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..engine.batch import warm_up_batch
    from ..engine.generate import warm_up
    from ..server import Server, create_app

    if args.max_concurrency is not None:  # the name before batching; same meaning for a client
        print("note: --max-concurrency is now --max-batch", file=sys.stderr)
        args.max_batch = args.max_batch or args.max_concurrency
    if (args.max_batch is not None and args.max_batch < 1) or args.queue_size < 0 or args.prefill_chunk < 1 \
            or not 0 < args.port < 65536:
        raise BadArgumentError("need --max-batch >= 1, --queue-size >= 0, --prefill-chunk >= 1 and a port in 1..65535")
    sock = bind_socket(args.host, args.port)  # before loading: a busy port fails in a second, not after
    lm = load_from_args(args)
    max_batch = args.max_batch or default_max_batch(lm.model)
    warm_up(lm.model)  # so that the first request does not pay for loading the kernels
    if max_batch > 1:
        warm_up_batch(lm.model)  # nor the first two that overlap
    name = args.model_name or (args.model if args.model and looks_like_hub_id(args.model)  # org/name, as asked
                               else os.path.basename(lm.path.rstrip("/")))
    server = Server(lm, name, max_batch, args.queue_size, args.api_key, args.prefill_chunk, engine_thread=False)
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (batch of up to {max_batch})", file=sys.stderr,
          flush=True)
    http = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
    serve_on_main_thread(http, sock, server.engine)
    return 0


def serve_on_main_thread(http, sock, engine) -> None:
    """HTTP on a thread, the engine loop on this (main) thread: numba's OpenMP kernels ran
    3-4x slower when launched from a second thread (docs/BENCHMARKS.md "Serving"). SIGINT
    and SIGTERM close the engine (its loop ends every open request at the step boundary and
    returns), then the HTTP server; the HTTP server ending closes the engine too."""
    def serve_http() -> None:
        try:
            http.run(sockets=[sock])
        finally:
            engine.close()  # also when uvicorn could not start: the loop below must end

    # a handler that raised could land inside a step; closing lets the step finish
    previous = {sig: signal.signal(sig, lambda *_: engine.close()) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=serve_http, name="powerinfer-http", daemon=True)
    thread.start()
    try:
        engine.run()  # returns when the engine is closed
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        http.should_exit = True
        thread.join(timeout=30)


MAX_DEFAULT_BATCH = 8  # beyond it a 2-16 core machine gains little (docs/BENCHMARKS.md, "serving")


def default_max_batch(model) -> int:
    """As many sequences as half the available memory holds KV caches of the full context
    for, between 1 and MAX_DEFAULT_BATCH."""
    from ..engine.packed import available_ram

    a = model.args
    per_sequence = 2 * a.n_layers * a.n_kv_heads * a.head_dim * 4 * a.max_seq_len  # fp32 keys and values
    return max(1, min(MAX_DEFAULT_BATCH, available_ram() // 2 // max(per_sequence, 1)))


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on (host, port), or a one-line error when the address is
    unknown or taken (uvicorn would report it only after the model had loaded, exit 3)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise BadArgumentError(f"--host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise BadArgumentError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock
