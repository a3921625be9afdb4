"""The edge's connection budget and file-descriptor limit (http/edge.py), without sockets."""

from __future__ import annotations

import resource
from typing import Any

import pytest
from analysis_queue.config import Settings
from analysis_queue.core.client import CORE_CONNECTIONS_MAX
from analysis_queue.http import edge
from analysis_queue.http.edge import (
    FD_RESERVE,
    FD_TARGET_WHEN_UNLIMITED,
    MAX_CONNECTIONS_CEILING,
    EdgeSettings,
    raise_fd_limit,
)

BESIDES = 10 + 1 + CORE_CONNECTIONS_MAX + FD_RESERVE  # pool, LISTEN, Core, the rest


def test_the_default_cap_leaves_room_for_everything_else_below_the_fd_limit() -> None:
    small = EdgeSettings.from_settings(Settings(), fd_soft=1024)
    assert small.fds_besides_clients == BESIDES
    assert small.lane_slots == (1024 - BESIDES) // 16
    assert small.max_connections == 1024 - BESIDES - small.lane_slots
    assert small.fits_fd_limit
    big_pool = EdgeSettings.from_settings(Settings(pool_max_size=50), fd_soft=1024)
    assert big_pool.max_connections < small.max_connections
    assert big_pool.fits_fd_limit


def test_the_default_cap_has_a_ceiling_whatever_the_fds() -> None:
    huge = EdgeSettings.from_settings(Settings(), fd_soft=1 << 20)
    assert (huge.max_connections, huge.lane_slots) == (MAX_CONNECTIONS_CEILING, 64)


def test_a_tiny_fd_limit_still_serves() -> None:
    tiny = EdgeSettings.from_settings(Settings(), fd_soft=64)
    assert tiny.max_connections == 1 and tiny.lane_slots == 2
    assert not tiny.fits_fd_limit  # and the start says so


def test_an_explicit_cap_is_kept_and_checked_against_the_fd_limit() -> None:
    explicit = EdgeSettings.from_settings(Settings(max_connections=500), fd_soft=20_000)
    assert (explicit.max_connections, explicit.lane_slots) == (500, 31)
    assert explicit.fits_fd_limit
    too_many = EdgeSettings.from_settings(Settings(max_connections=50_000), fd_soft=20_000)
    assert too_many.max_connections == 50_000 and not too_many.fits_fd_limit


def test_settings_reach_the_handler() -> None:
    settings = EdgeSettings.from_settings(
        Settings(header_timeout_s=3, keepalive_timeout_s=7), fd_soft=1024
    )
    kwargs = settings.handler_kwargs()
    assert settings.header_timeout_s == 3
    assert kwargs["keepalive_timeout"] == 7
    assert kwargs["lingering_time"] == edge.LINGER_S
    assert kwargs["max_field_size"] == kwargs["max_line_size"] == 8190


class FakeRlimit:
    def __init__(self, soft: int, hard: int, refuse: bool = False) -> None:
        self.soft, self.hard, self.refuse = soft, hard, refuse

    def getrlimit(self, _which: int) -> tuple[int, int]:
        return self.soft, self.hard

    def setrlimit(self, _which: int, limits: tuple[int, int]) -> None:
        if self.refuse:
            raise ValueError("not allowed")
        self.soft, self.hard = limits


@pytest.fixture
def rlimit(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(fake: FakeRlimit) -> FakeRlimit:
        monkeypatch.setattr(edge.resource, "getrlimit", fake.getrlimit)
        monkeypatch.setattr(edge.resource, "setrlimit", fake.setrlimit)
        return fake

    return install


def test_the_soft_fd_limit_is_raised_to_the_hard_one(rlimit: Any) -> None:
    fake = rlimit(FakeRlimit(1024, 524_288))
    limit = raise_fd_limit()
    assert (limit.before, limit.soft, limit.hard) == (1024, 524_288, 524_288)
    assert fake.soft == 524_288


def test_an_unlimited_hard_limit_raises_the_soft_one_to_a_bound(rlimit: Any) -> None:
    rlimit(FakeRlimit(256, resource.RLIM_INFINITY))
    limit = raise_fd_limit()
    assert (limit.soft, limit.hard) == (FD_TARGET_WHEN_UNLIMITED, None)


def test_a_refused_raise_keeps_the_soft_limit(rlimit: Any) -> None:
    rlimit(FakeRlimit(256, resource.RLIM_INFINITY, refuse=True))
    assert raise_fd_limit().soft == 256


def test_nothing_to_raise(rlimit: Any) -> None:
    rlimit(FakeRlimit(20_000, 20_000))
    limit = raise_fd_limit()
    assert limit.soft == limit.before == 20_000
