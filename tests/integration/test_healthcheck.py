"""The image's health check, run here: it asks the port the service listens on."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

DOCKERFILE = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()


def _healthcheck_code() -> str:
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    line = next(ln for ln in joined.splitlines() if ln.startswith("HEALTHCHECK "))
    command = json.loads(line[line.index("CMD ") + 4 :])
    assert command[:2] == ["python", "-c"], command
    return str(command[2])


def test_the_healthcheck_asks_the_port_the_service_listens_on() -> None:
    """Run the image's probe here: healthy against /healthz on AQ_PORT, not on 8080 alone."""

    class Healthz(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *_args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        probe = [sys.executable, "-c", _healthcheck_code()]
        up = subprocess.run(probe, env={"AQ_PORT": str(port)}, capture_output=True, timeout=10)
        assert up.returncode == 0, up.stderr
    finally:
        server.shutdown()
        server.server_close()
    down = subprocess.run(probe, env={"AQ_PORT": str(port)}, capture_output=True, timeout=10)
    assert down.returncode != 0, "healthy with nothing listening"
