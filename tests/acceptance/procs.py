"""Process plumbing the acceptance tests share: real ``serve`` and ``core-sim`` processes.

The secrets every process of a test agrees on, the fast sweep and lease settings under which a
killed instance's work is recovered within seconds, the environment a child process gets (the
parent's, minus any ``AQ_`` setting of its own), and :class:`Proc`, one process with its output
in a log file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SECRETS = {
    "AQ_JWT_SECRET": "faults-jwt-secret-0123456789abcdef0123",
    "AQ_ADMIN_TOKEN": "faults-admin-token",
    "AQ_CORE_CALLBACK_SECRET": "faults-callback-secret",
}
RELEASE_WINDOW_S = 6.0
RELEASE_BACKOFF_MAX_S = 1.0
SERVICE_ENV = {
    "AQ_SWEEP_INTERVAL_S": "1",
    "AQ_RUNNING_QUIET_S": "1",
    "AQ_RESERVATION_STALE_S": "2",
    "AQ_RELEASE_WINDOW_S": str(RELEASE_WINDOW_S),
    "AQ_RELEASE_BACKOFF_BASE_S": "0.2",
    "AQ_RELEASE_BACKOFF_MAX_S": str(RELEASE_BACKOFF_MAX_S),
    "AQ_LISTENER_PING_S": "0.5",
    "AQ_CLAIM_LEASE_S": "3",
}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "analysis_queue.cli", *args]


def base_env(tmp: Path, **values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AQ_")}
    env.update(SECRETS, AQ_DATA_DIR=str(tmp), AQ_LOG_LEVEL="INFO")
    env.update(values)
    return env


class Proc:
    """One real process, its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.popen = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: int) -> None:
        if self.alive:
            self.popen.send_signal(sig)

    async def wait_exit(self, timeout_s: float) -> int | None:
        """The exit code, or None if still running after ``timeout_s`` (never blocks the loop)."""
        deadline = time.monotonic() + timeout_s
        while self.popen.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.popen.poll()

    def kill(self) -> None:
        if self.alive:
            self.popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(5)
        self._log.close()

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def count(self, needle: str) -> int:
        return sum(needle in line for line in self.text().splitlines())

    def excerpt(self, *needles: str, limit: int = 8) -> str:
        """The last lines that mention a needle (default: warnings and errors)."""
        wanted = needles or ('"level":"warning"', '"level":"error"', '"level":"critical"')
        lines = [ln for ln in self.text().splitlines() if any(n in ln for n in wanted)]
        if not needles:
            lines = [ln for ln in lines if "core unreachable" not in ln]
        shown = "\n    ".join(ln[:600] for ln in lines[-limit:])
        return f"  [{self.name}] {self.log_path}\n    {shown or '(nothing)'}"


@dataclass
class Node:
    name: str
    port: int
    proc: Proc | None = None
    live: bool = False
    starts: int = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"
