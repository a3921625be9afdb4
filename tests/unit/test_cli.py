"""The command as an operator meets it: ``--version``, ``python -m analysis_queue``."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata


def test_version_from_the_module_and_the_command_entry() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "analysis_queue", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"analysis-queue {metadata.version('analysis-queue')}"


def test_no_command_is_a_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "analysis_queue"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "usage: analysis-queue" in result.stderr


# What a serving process is given before it reads its settings: the event loop and the young
# generation's threshold (``cli._tune_gc``). Run as a process: both are process-wide.
_RUNTIME = """
import asyncio, gc, os, sys
for name in list(os.environ):
    if name.startswith("AQ_"):
        del os.environ[name]
from analysis_queue import cli
default = gc.get_threshold()
code = cli.main([sys.argv[1]])
print(code, default, gc.get_threshold(), type(asyncio.get_event_loop_policy()).__module__)
"""


def test_serve_collects_the_young_generation_less_often_on_uvloop() -> None:
    import gc

    from analysis_queue.cli import EXIT_CONFIG, GC_YOUNG_THRESHOLD

    default = gc.get_threshold()
    result = subprocess.run(
        [sys.executable, "-c", _RUNTIME, "serve"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Refused for its missing settings (78), after the runtime was set up.
    expected = (GC_YOUNG_THRESHOLD, default[1], default[2])
    assert result.stdout.strip().splitlines()[-1] == (
        f"{EXIT_CONFIG} {default} {expected} uvloop"
    ), result.stdout + result.stderr
