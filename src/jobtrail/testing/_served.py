"""Serving a fake from a background thread: each fake says how it starts and stops, this runs it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Self

from aiohttp import web


class ServedInThread:
    """``start()`` runs the fake's ``start_async()`` on an event loop of its own thread and returns once
    it is serving; ``stop()`` runs ``stop_async()`` there and joins the thread. Also a context manager."""

    #: the thread's name (shown in stack dumps of a hung test)
    thread_name = "fake"
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    async def start_async(self) -> Any:
        raise NotImplementedError

    async def stop_async(self) -> None:
        for runner in getattr(self, "_served", []):
            await runner.cleanup()
        self._served: list[web.AppRunner] = []

    async def serve(self, app: web.Application, host: str, port: int = 0) -> tuple[str, int]:
        """Serve ``app`` on ``host:port`` (0: a free port) until :meth:`stop_async`; (base URL, port)."""
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._served = [*getattr(self, "_served", []), runner]
        server = site._server
        assert server is not None
        bound = int((getattr(server, "sockets", None) or [])[0].getsockname()[1])
        return f"http://{host}:{bound}", bound

    def start(self) -> Self:
        """Serve from a background thread; returns once the port is bound."""
        ready = threading.Event()
        problem: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.start_async())
            except BaseException as exc:
                problem.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop_async())
            loop.close()

        self._thread = threading.Thread(target=run, name=self.thread_name, daemon=True)
        self._thread.start()
        ready.wait(10)
        if problem:
            raise problem[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
