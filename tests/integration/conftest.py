from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from analysis_queue.dev.core_sim import CoreSimulator
from bouncer import Route
from support import CALLBACK_SECRET, Harness


@pytest.fixture
async def harness(database_url: str, tmp_path: Path, db_route: Route) -> AsyncIterator[Harness]:
    sim = CoreSimulator(callback_secret=CALLBACK_SECRET, judge_time_s=0.05)
    await sim.start()
    h = Harness(database_url, tmp_path, sim, aiohttp.ClientSession(), route=db_route)
    try:
        yield h
    finally:
        await h.close()
