"""``serve`` stopped by SIGTERM at each moment of its start: a clean return, never a traceback.

A stop can arrive before the instance listens: while it waits for the database (``runner.setup``)
or while its port opens (``start_site``). Either is the operator's stop, and the process exits
0, as after a stop once it serves. Found by a real ``serve`` behind PgBouncer in CI, which got
its SIGTERM while the port opened and ended with a CancelledError (exit 1).
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
from analysis_queue import app as app_module
from analysis_queue.app import build_app, serve
from analysis_queue.config import Settings
from support import ADMIN_TOKEN, CALLBACK_SECRET, JWT_SECRET, Harness, free_port


def _settings(h: Harness) -> Settings:
    return Settings(
        database_url=h.database_url,
        core_url=h.sim.base_url,
        core_callback_secret=CALLBACK_SECRET,
        jwt_secret=JWT_SECRET,
        admin_token=ADMIN_TOKEN,
        host="127.0.0.1",
        port=free_port(),
        sweep_interval_s=0,
        data_dir=h.tmp,
        instance_id="signals",
    )


async def test_a_stop_while_the_port_opens_is_a_clean_return(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings(harness)
    opening = app_module.start_site

    async def signalled_while_opening(*args: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # serve's handler is installed: it takes it
        await asyncio.sleep(0.05)  # the handler runs while the port opens
        return await opening(*args)

    monkeypatch.setattr(app_module, "start_site", signalled_while_opening)
    started: list[bool] = []
    await asyncio.wait_for(serve(build_app(settings), settings, lambda: started.append(True)), 30)
    assert not started, "it said it listens after it was told to stop"


async def test_a_stop_once_serving_is_a_clean_return(harness: Harness) -> None:
    settings = _settings(harness)
    started = asyncio.Event()
    serving = asyncio.create_task(serve(build_app(settings), settings, started.set))
    await asyncio.wait_for(started.wait(), 30)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(serving, 30)
