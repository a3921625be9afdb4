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
