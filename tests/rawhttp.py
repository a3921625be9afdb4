"""HTTP over a bare socket, for what an HTTP client will not send: a request that stops halfway,
headers and no body, garbage, a socket that says nothing. Every wait is bounded."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

HEAD_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class RawReply:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip()

    def json(self) -> Any:
        return orjson.loads(self.body)


class Raw:
    """One client connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, base_url: str) -> Raw:
        parts = urlsplit(base_url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self, timeout_s: float = 5.0) -> RawReply:
        """The next response, read by its Content-Length."""
        async with asyncio.timeout(timeout_s):
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers: dict[str, str] = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return RawReply(status, headers, body)

    async def closed_after(self, timeout_s: float) -> float:
        """Seconds until the server closed the connection (reading and dropping whatever it
        sends); AssertionError if it is still open after ``timeout_s``."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            raise AssertionError(f"still open after {timeout_s} s") from None
        except ConnectionResetError:
            pass
        return time.monotonic() - started

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def request_head(
    method: str, path: str, headers: dict[str, str] | None = None, *, host: str = "test"
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
