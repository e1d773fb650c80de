"""`speculant serve`: the OpenAI-compatible server on uvicorn."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from speculant.cli.options import config_default, engine_options


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
    _add_limit_args(p)
    r = p.add_argument_group("scale-out (Ray Serve; pip install speculant[ray])")
    r.add_argument("--replicas", type=int, default=None,
                   help="engine replicas behind one endpoint on Ray Serve, each with --threads "
                        "threads (default: the cores divided among them); without it: one process")
    r.add_argument("--ray-address", default="local",
                   help="with --replicas: 'local' starts a Ray instance, 'auto' or an address "
                        "joins a running cluster")


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    from speculant.engine.config import EngineConfig
    from speculant.server.config import ServerConfig

    d = lambda name: config_default(ServerConfig, name)  # noqa: E731
    g = p.add_argument_group("limits and prompts (each refused with a 4xx before any heavy work)")
    g.add_argument("--max-body-bytes", type=int, default=d("max_body_bytes"),
                   help="request body size; beyond it: 413")
    g.add_argument("--body-timeout-s", type=float, default=d("body_timeout_s"),
                   help="a request body must arrive within this; else 408")
    g.add_argument("--max-prompt-chars", type=int, default=d("max_prompt_chars"),
                   help="prompt characters (chat: all message contents), checked before tokenizing")
    g.add_argument("--max-prompt-tokens", type=int, default=d("max_prompt_tokens"),
                   help="prompt tokens (default: the context length)")
    g.add_argument("--max-messages", type=int, default=d("max_messages"),
                   help="messages in one chat request")
    g.add_argument("--max-stop-strings", type=int, default=d("max_stop_strings"))
    g.add_argument("--max-stop-chars", type=int, default=d("max_stop_chars"),
                   help="characters in one stop string")
    g.add_argument("--parse-special-tokens", action="store_true",
                   help="parse control tokens ('<|im_end|>', ...) typed in chat message content; "
                        "by default content is plain text and cannot inject them")
    g.add_argument("--max-prefill-chunk-decoding", type=int,
                   default=config_default(EngineConfig, "max_prefill_chunk_decoding"),
                   help="longest chunk of one prompt per step while any request decodes: "
                        "bounds how much a long prompt's prefill slows the others")


def _server_config(args):
    from speculant.server.config import ServerConfig

    return ServerConfig(
        max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s,
        max_prompt_chars=args.max_prompt_chars, max_prompt_tokens=args.max_prompt_tokens,
        max_messages=args.max_messages, max_stop_strings=args.max_stop_strings,
        max_stop_chars=args.max_stop_chars, parse_special_tokens=args.parse_special_tokens)


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
    opts["max_prefill_chunk_decoding"] = args.max_prefill_chunk_decoding
    server_config = _server_config(args)
    if args.replicas is not None:
        return _run_replicas(args, EngineConfig(model=args.model, **opts), server_config)
    # Before the engine loads: its start-up warnings (a KV cache smaller than one request of
    # --max-model-len) must reach the terminal.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    app = create_app(EngineConfig(model=args.model, **opts), api_key=args.api_key,
                     max_queue=args.max_queue, config=server_config)
    state = app.state.server
    print(f"[speculant] loaded {state.model_id} in {time.perf_counter() - t0:.2f} s; speculators: "
          f"{', '.join(state.speculators) or 'none'}; serving on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    # On shutdown, streams still open after the grace period are cancelled (and aborted).
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False,
                timeout_graceful_shutdown=10)
    return 0


def _run_replicas(args, engine, server_config) -> int:
    """`--replicas N`: engines on Ray Serve (imported only here: one process never loads Ray)."""
    try:
        from speculant.server.ray_serve import ScaleOutConfig, serve_replicas
    except ImportError as exc:
        raise ValueError(f"--replicas needs Ray Serve: pip install 'speculant[ray]' ({exc})") \
            from exc
    scale = ScaleOutConfig(replicas=args.replicas, threads_per_replica=args.threads,
                           api_key=args.api_key)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        serve_replicas(engine, scale, server_config, args.host, args.port, args.ray_address)
    except KeyboardInterrupt:
        pass
    return 0
