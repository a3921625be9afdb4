"""Importing the client starts nothing of the service: no database driver, no settings read,
no server module loaded. Checked in a fresh interpreter, with settings that would make the
service refuse to start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, sys
import analysis_queue.client as client
from analysis_queue.client import AnalysisQueueClient, AdminClient
print(json.dumps(sorted(sys.modules)))
"""


def test_importing_the_client_loads_no_server_module_driver_or_settings() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AQ_")}
    # The service exits at once on an unknown setting; the client never reads one.
    env.update(AQ_DATABSE_URL="postgresql://nowhere/none", AQ_PORT="not-a-port")
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout))
    ours = {m for m in loaded if m == "analysis_queue" or m.startswith("analysis_queue.")}
    assert ours and all(
        m == "analysis_queue" or m.startswith("analysis_queue.client") for m in ours
    )
    for heavy in ("asyncpg", "pydantic_settings", "jwt", "prometheus_client", "orjson", "uvloop"):
        assert heavy not in loaded, f"importing the client loaded {heavy}"
    assert {"aiohttp", "pydantic", "tenacity"} <= loaded
