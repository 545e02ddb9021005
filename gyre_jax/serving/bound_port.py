"""The port an aiohttp site bound (asked for port 0: the OS chose it)."""
from __future__ import annotations

import asyncio

from aiohttp import web


def bound_port(site: web.TCPSite) -> int:
    """aiohttp exposes no bound port, so read the started site's server socket."""
    server = site._server  # noqa: SLF001 - the only place aiohttp keeps it
    if not isinstance(server, asyncio.Server) or not server.sockets:
        raise RuntimeError(f"bound_port: site {site.name} is not serving (call `await site.start()` first)")
    return server.sockets[0].getsockname()[1]
