"""``kdsa serve``: the OpenAI-compatible HTTP server over the batching engine.

The port is checked before anything is loaded (a port in use is one error line at once, exit
2); if the engine dies while serving, ``/health`` answers 503 and the command exits 1 so a
supervisor restarts it (``docs/serving.md``, Reliability).
"""

from __future__ import annotations


def register(sub) -> None:
    from kdsa.cli.generate_cmd import add_engine_args

    p = sub.add_parser("serve", help="OpenAI-compatible chat-completions server",
                       description="Serve POST /v1/chat/completions (OpenAI: streaming, "
                                   "tools, reasoning_effort), POST /v1/messages and "
                                   "/v1/messages/count_tokens (Anthropic), GET /v1/models, "
                                   "GET /health and GET /metrics (Prometheus); all "
                                   "connections share one continuous-batching engine.")
    add_engine_args(p)
    from kdsa.cli.config_args import positive_int

    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="the id clients send (default: the "
                                                      "preset or checkpoint name)")
    p.add_argument("--default-max-tokens", type=positive_int, default=None,
                   help="max_tokens when a request gives none (default: the rest of the "
                        "context, or of the cache pool when it holds fewer tokens)")
    p.add_argument("--no-warmup", action="store_true", help="compile on the first request")
    g = p.add_argument_group("image limits (vision models; a request past one is a 400)")
    g.add_argument("--max-images", type=int, default=8, help="images per request (default 8)")
    g.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                   help="width x height of one image, checked before decoding (default 4096^2)")
    g.add_argument("--max-image-bytes", type=int, default=16 * 2**20,
                   help="encoded size of one image (default 16 MiB)")
    p.set_defaults(run=run)


def image_limits_from_args(args):
    from kdsa.model.vision.inputs import ImageLimits

    return ImageLimits(max_images=args.max_images, max_pixels=args.max_image_pixels,
                       max_bytes=args.max_image_bytes)


def run(args) -> int:
    import logging
    import sys

    from kdsa.cli import generate_cmd
    from kdsa.infer.server_run import EngineStopped, check_port, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    limits = image_limits_from_args(args)  # bad values fail before the model loads
    check_port(args.host, args.port)  # a port in use: one line now, not after the warm-up
    engine, fmt, name = generate_cmd.engine_from_args(args)
    if not args.no_warmup:
        engine.runner.warmup()
    try:
        serve(engine, fmt, host=args.host, port=args.port, model_name=args.model_name or name,
              default_max_tokens=args.default_max_tokens, image_limits=limits)
    except EngineStopped as e:
        print(f"kdsa serve: error: the engine stopped ({e}); exiting", file=sys.stderr)
        return 1
    return 0
