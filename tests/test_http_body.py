"""A provider's answer is read up to the limit, however the provider frames it.

A real aiohttp server on 127.0.0.1 answers with a declared length, chunked, and gzip-compressed
bodies; the reader must return the exact bytes of an honest answer, and never more than the limit of
one that is large or that inflates (a small compressed body that decompresses to megabytes).
"""

from __future__ import annotations

import asyncio
import gzip
import tracemalloc

import aiohttp
from aiohttp import web

from jobtrail.providers.http import read_at_most

SMALL = b'{"id": "job_1", "status": "running"}'
LARGE = b"x" * (300 * 1024)
#: 32 MiB of zeros compress to about 32 KiB: the declared length says nothing about what inflates
BOMB = gzip.compress(b"\0" * (32 * 1024 * 1024), compresslevel=9)


async def _identity(_request: web.Request) -> web.Response:
    return web.Response(body=SMALL, content_type="application/json")


async def _large(_request: web.Request) -> web.Response:
    return web.Response(body=LARGE)


async def _chunked(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for i in range(0, len(SMALL), 7):
        await resp.write(SMALL[i : i + 7])
    await resp.write_eof()
    return resp


async def _bomb(_request: web.Request) -> web.Response:
    resp = web.Response(body=BOMB)
    resp.headers["Content-Encoding"] = "gzip"
    return resp


async def _serve_and_read(path: str, limit: int) -> bytes:
    app = web.Application()
    app.router.add_get("/identity", _identity)
    app.router.add_get("/large", _large)
    app.router.add_get("/chunked", _chunked)
    app.router.add_get("/bomb", _bomb)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        # as the provider's sessions are made: read_at_most decompresses, and proves the stream whole
        plain = aiohttp.ClientSession(auto_decompress=False)
        async with plain as session, session.get(f"http://127.0.0.1:{port}{path}") as resp:
            body = await read_at_most(resp, limit)
    finally:
        await runner.cleanup()
    assert isinstance(body, bytes)
    return body


def _read(path: str, limit: int) -> bytes:
    return asyncio.run(_serve_and_read(path, limit))


def test_an_honest_answer_arrives_byte_for_byte_whatever_its_framing() -> None:
    assert _read("/identity", 1024 * 1024) == SMALL
    assert _read("/chunked", 1024 * 1024) == SMALL


def test_an_answer_longer_than_the_limit_is_cut_at_the_limit() -> None:
    assert _read("/identity", 10) == SMALL[:10]
    assert _read("/large", 100 * 1024) == LARGE[: 100 * 1024]
    assert _read("/chunked", 5) == SMALL[:5]


def test_a_small_compressed_body_that_inflates_is_never_read_past_the_limit() -> None:
    assert len(BOMB) < 64 * 1024  # small enough to look like a small answer by its declared length
    tracemalloc.start()
    try:
        body = _read("/bomb", 256 * 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, f"{peak / 2**20:.1f} MiB held while reading a 256 KiB answer"
    assert len(body) == 256 * 1024
    assert body == b"\0" * (256 * 1024)
