"""``kdsa serve``: the OpenAI-compatible HTTP server over the batching engine."""

from __future__ import annotations


def register(sub) -> None:
    from kdsa.cli.generate_cmd import add_engine_args

    p = sub.add_parser("serve", help="OpenAI-compatible chat-completions server",
                       description="Serve POST /v1/chat/completions (streaming, tools, "
                                   "reasoning_effort), GET /v1/models and GET /health; all "
                                   "connections share one continuous-batching engine.")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="the id clients send (default: the "
                                                      "preset or checkpoint name)")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens when a request gives none (default: the rest of the context)")
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

    from kdsa.cli.generate_cmd import engine_from_args
    from kdsa.infer.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    limits = image_limits_from_args(args)  # bad values fail before the model loads
    engine, fmt, name = engine_from_args(args)
    if not args.no_warmup:
        engine.runner.warmup()
    serve(engine, fmt, host=args.host, port=args.port, model_name=args.model_name or name,
          default_max_tokens=args.default_max_tokens, image_limits=limits)
    return 0
