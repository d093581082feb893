"""A request's JSON body, read for the HTTP servers (``server.py``, ``anthropic_server.py``):
decoded off the event loop, nested at most :data:`MAX_JSON_DEPTH` levels; and :func:`off_loop`,
which runs the request checks (tokenizing, image decoding) in the thread pool, so one large
request does not stall the other streams, ``/health`` or ``/metrics``."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from kdsa.infer import openai_api as api

# the parsed JSON body of a request (read_json), for its tool rounds (aiohttp >= 3.12: a key)
BODY = web.RequestKey("body", object) if hasattr(web, "RequestKey") else "kdsa.body"
MAX_JSON_DEPTH = 64  # arrays and objects inside each other in a request body


def _deeper_than(value, limit: int) -> bool:
    """Whether JSON ``value`` nests arrays / objects more than ``limit`` levels (iterative: the
    checks and renderings after it recurse, and Python's stack is shallower than the parser's)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:  # arrays and objects only: a body of 8M numbers pushes nothing
        x, depth = stack.pop()
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in (x.values() if isinstance(x, dict) else x)
                     if isinstance(c, (dict, list)))
    return False


def _decode(text: str):
    """JSON text -> value, refused when nested deeper than :data:`MAX_JSON_DEPTH` (one call in
    the thread pool: both passes are seconds for a 16 MiB body)."""
    body = json.loads(text)
    if _deeper_than(body, MAX_JSON_DEPTH):
        raise api.ApiError(f"the request body nests arrays and objects deeper than "
                           f"{MAX_JSON_DEPTH} levels")
    return body


async def read_json(request: web.Request):
    """The request body as JSON, decoded off the event loop (a 16 MiB body takes a while); a
    400 ``ApiError`` when it is not JSON or nests deeper than :data:`MAX_JSON_DEPTH`."""
    try:
        text = await request.text()
        body = await asyncio.get_running_loop().run_in_executor(None, _decode, text)
    except (ValueError, RecursionError, LookupError) as e:
        # ValueError: JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits;
        # RecursionError: nesting deeper than the parser's stack; LookupError: an unknown
        # charset in the Content-Type
        raise api.ApiError(f"the request body is not valid JSON ({type(e).__name__}: "
                           f"{str(e)[:200]})") from None
    except web.RequestPayloadError as e:  # e.g. a Content-Encoding the body does not decode as
        raise api.ApiError(f"the request body could not be read ({str(e)[:200]})") from None
    request[BODY] = body
    return body


async def off_loop(fn, *args, **kw):
    """``fn(*args, **kw)`` in the default thread pool: the request checks tokenize the prompt
    and decode images (seconds for a large body), which must not stall the other requests'
    streams, ``/health`` or ``/metrics``."""
    return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kw))
