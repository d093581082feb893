"""Running the HTTP app of ``server.py``.

``start_server(engine, chat_format, ...)`` runs the app on its own event-loop thread and returns
a handle with ``port`` and ``stop()`` (tests, notebooks); ``serve(...)`` blocks (``kdsa serve``)
until SIGINT / SIGTERM or the engine's death (:class:`EngineStopped`); ``check_port`` tells at
once whether ``serve`` could listen (before a model is loaded).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import threading

from aiohttp import web

from kdsa.infer.server import build_app, engine_failure

log = logging.getLogger("kdsa.serve")


class ServerHandle:
    def __init__(self, runner: web.AppRunner, loop, thread, port: int):
        self._runner, self._loop, self._thread, self.port = runner, loop, thread, port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 30) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)


def start_server(engine, chat_format, *, host: str = "127.0.0.1", port: int = 0,
                 **kw) -> ServerHandle:
    """Serve on a background thread; ``port=0`` picks a free port (see ``handle.port``)."""
    app = build_app(engine, chat_format, **kw)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, handle_signals=False)
    ready: dict = {}

    def run():
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            loop.run_until_complete(site.start())
            ready["port"] = site._server.sockets[0].getsockname()[1]
        except Exception as e:  # reported to the caller below
            ready["error"] = e
        ready["event"].set()
        if "error" not in ready:
            loop.run_forever()

    ready["event"] = threading.Event()
    t = threading.Thread(target=run, daemon=True, name="kdsa-http")
    t.start()
    ready["event"].wait(60)
    if "error" in ready or "port" not in ready:
        raise RuntimeError(f"server did not start: {ready.get('error', 'timeout')}")
    return ServerHandle(runner, loop, t, ready["port"])


def check_port(host: str, port: int) -> None:
    """Raise ``ValueError`` (one line) when ``host:port`` cannot be listened on, e.g. another
    server holds it: a bind test as asyncio's own (``SO_REUSEADDR``), so ``kdsa serve`` fails
    before loading a model rather than after its warm-up."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: must be in [0, 65535]")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    bound, unavailable = 0, None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
                bound += 1
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(f"port {port} on {host} is in use (another server? "
                                     f"choose a free one with --port)") from None
                if e.errno != errno.EADDRNOTAVAIL:
                    raise ValueError(f"cannot listen on {host} port {port}: "
                                     f"{e.strerror or e}") from None
                unavailable = e  # a family not enabled here: asyncio skips it too
    if not bound and unavailable is not None:
        raise ValueError(f"cannot listen on {host} port {port}: {unavailable.strerror}")


class EngineStopped(RuntimeError):
    """``serve`` ended because the engine died (the message says why)."""


def serve(engine, chat_format, *, host: str = "127.0.0.1", port: int = 8000,
          health_poll_s: float = 0.5, **kw) -> None:
    """Serve in the foreground until SIGINT / SIGTERM (then return) or until the engine dies
    (then raise :class:`EngineStopped`, after ``/health`` has had a moment to answer 503)."""
    app = build_app(engine, chat_format, **kw)
    why = asyncio.run(_serve_until_stopped(app, host, port, health_poll_s))
    if why is not None:
        raise EngineStopped(why)


async def _serve_until_stopped(app, host, port, poll_s) -> str | None:
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    stop = asyncio.Event()
    loop, installed = asyncio.get_running_loop(), []
    for sig in (signal.SIGINT, signal.SIGTERM):
        prev = signal.getsignal(sig)
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append((sig, prev))
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass
    why = None
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        log.info("serving on http://%s:%d", host, port)
        while not stop.is_set():
            why = engine_failure(app)
            if why is not None:
                log.error("the engine has stopped (%s); shutting down", why)
                await asyncio.sleep(poll_s)  # clients polling /health see the 503
                break
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except asyncio.TimeoutError:
                pass
    finally:
        for sig, prev in installed:
            loop.remove_signal_handler(sig)
            signal.signal(sig, prev)
        await runner.cleanup()
    return why
