"""Unit tests run without a database or a network socket: connecting or binding one fails the
test (such a test belongs in tests/integration). The event loop's own socketpair is allowed."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

_NETWORK = (socket.AF_INET, socket.AF_INET6)


class SocketInAUnitTest(RuntimeError):
    """A unit test tried to open a network socket: it belongs in tests/integration."""


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def guarded(real: Any) -> Any:
        def call(self: socket.socket, *args: Any, **kwargs: Any) -> Any:
            if self.family in _NETWORK:
                raise SocketInAUnitTest("unit tests open no network socket; move it to integration")
            return real(self, *args, **kwargs)

        return call

    for name in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, name, guarded(getattr(socket.socket, name)))
    yield
