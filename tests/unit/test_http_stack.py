"""Issue 57: the HTTP server runs uvicorn on uvloop and httptools (as SGLang's server does), the
C event loop and HTTP parser: the pure-Python ones cost much of the HTTP process's CPU per token."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI

from radixserve.launch import uvicorn_config
from radixserve.server_args import ServerArgs


def test_uvicorn_takes_httptools_and_uvloop():
    import uvloop
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    config = uvicorn_config(FastAPI(), ServerArgs())
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol
    loop = config.get_loop_factory()()
    try:
        assert isinstance(loop, uvloop.Loop)
        assert isinstance(loop, asyncio.AbstractEventLoop)
    finally:
        loop.close()
