"""`speculant serve`: the OpenAI-compatible server on uvicorn."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from speculant.cli.options import engine_options


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8080, help="port to listen on")
    g.add_argument("--parallel", type=int, default=8,
                   help="sequences decoded together (slots); more requests wait in the queue")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every path but /health")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a slot or KV cache; beyond this: HTTP 429")


def run_serve(args) -> int:
    import uvicorn

    from speculant.engine.config import EngineConfig
    from speculant.server.app import create_app

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.parallel < 1 or args.max_queue < 1:
        raise ValueError("--parallel and --max-queue must be >= 1")
    opts = engine_options(args, max_num_seqs=args.parallel)
    opts["max_queue"] = args.max_queue  # waiting beyond the free slots (Scheduler.add)
    t0 = time.perf_counter()
    app = create_app(EngineConfig(model=args.model, **opts), api_key=args.api_key,
                     max_queue=args.max_queue)
    state = app.state.server
    print(f"[speculant] loaded {state.model_id} in {time.perf_counter() - t0:.2f} s; speculators: "
          f"{', '.join(state.speculators) or 'none'}; serving on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # On shutdown, streams still open after the grace period are cancelled (and aborted).
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False,
                timeout_graceful_shutdown=10)
    return 0
