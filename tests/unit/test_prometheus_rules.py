"""The Prometheus rules an operator loads (deploy/prometheus/rules.yml): valid, and each alert
fires on the synthetic series of rules.test.yml that should page or ticket, and not on its
healthy neighbour. promtool is Debian's ``prometheus`` package (.ci/run installs it); without
it these tests skip and say so."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is missing (apt-get install prometheus; .ci/run does)"
)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=RULES, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_rules_are_valid() -> None:
    done = _promtool("check", "rules", "rules.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_each_alert_fires_when_it_should_and_not_otherwise() -> None:
    done = _promtool("test", "rules", "rules.test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_test_and_a_runbook_entry() -> None:
    rules = (RULES / "rules.yml").read_text()
    tests = (RULES / "rules.test.yml").read_text()
    operations = (RULES.parents[1] / "docs" / "operations.md").read_text()
    alerts = [line.split(":", 1)[1].strip() for line in rules.splitlines() if "- alert:" in line]
    assert len(alerts) == 6, alerts
    assert [a for a in alerts if f"alertname: {a}" not in tests] == []
    anchors = [
        line.split("#", 1)[1].strip().strip('"')
        for line in rules.splitlines()
        if "runbook: docs/operations.md#" in line
    ]
    assert len(anchors) == len(alerts)
    headings = {
        "-".join(line.lstrip("#").strip().lower().replace(",", "").split())
        for line in operations.splitlines()
        if line.startswith("### ")
    }
    assert [a for a in anchors if a not in headings] == []
