"""Settings, read from the environment with the ``AQ_`` prefix (pydantic-settings).

Production (``analysis-queue serve``) needs the database, Core and the three secrets set, and
refuses to start without them (:func:`missing_for_serve`): a misspelled ``AQ_CORE_URL`` must not
start a simulator that invents verdicts. Development (``analysis-queue dev``) asks for the
stand-ins by name: ``AQ_DATABASE_URL=embedded`` (a PostgreSQL server under ``DATA_DIR``),
``AQ_CORE_URL=simulator`` (the Core simulator in-process), and secrets generated once and kept in
``DATA_DIR/secrets.json``. An ``AQ_`` variable that is not a setting stops every command
(:func:`unknown_variables`), with the name it looks like.

Two database URLs: ``AQ_DATABASE_URL`` for the pool, which may be a transaction-pooling
PgBouncer (``AQ_DATABASE_POOLER=transaction``), and ``AQ_DIRECT_DATABASE_URL`` (default: the
same) for what needs a session of its own: LISTEN, migrations, the simulator's store
(docs/operations.md, "Behind PgBouncer").
"""

from __future__ import annotations

import difflib
import json
import os
import secrets
from collections.abc import Iterator, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

SECRETS_FILE = "secrets.json"
ENV_PREFIX = "AQ_"
EMBEDDED = "embedded"  # AQ_DATABASE_URL: the development server under DATA_DIR
SIMULATOR = "simulator"  # AQ_CORE_URL: the Core simulator, in-process
SECRET_NAMES = ("jwt_secret", "admin_token", "core_callback_secret")
_DSN_FIELDS = frozenset({"database_url", "direct_database_url"})
# Read by the tests and the benchmark, never by the service.
TOOLING_VARIABLES = frozenset({"AQ_TEST_DATABASE_URL", "AQ_BENCH_DATABASE_URL"})


class Pooler(StrEnum):
    """What ``AQ_DATABASE_URL`` points at, as far as the pool's connections can tell."""

    NONE = "none"  # PostgreSQL itself, or a pooler in session mode: a connection is a session
    # PgBouncer in transaction mode: a connection is a session only for one transaction, takes no
    # startup parameter but application_name, and keeps no prepared statement (before 1.21).
    TRANSACTION = "transaction"


# Why a variable is required beyond "serve needs it"; shown beside its name.
REQUIRED_BECAUSE = {
    "AQ_DIRECT_DATABASE_URL": "AQ_DATABASE_POOLER=transaction: LISTEN and migrations need a "
    "direct connection to PostgreSQL",
}


class Mode(StrEnum):
    """How an instance was started (logged at start)."""

    PRODUCTION = "production"  # serve: every dependency real and configured
    DEVELOPMENT = "development"  # dev, demo: stand-ins asked for by name


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "analysis-queue"


class Settings(BaseSettings):
    """The service's configuration. Env: ``AQ_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    database_url: str | None = Field(
        default=None,
        description="PostgreSQL DSN; `embedded` for the development server in DATA_DIR.",
    )
    direct_database_url: str | None = Field(
        default=None,
        description="DSN of a direct connection to PostgreSQL, for LISTEN and migrations; "
        "default AQ_DATABASE_URL. Required with AQ_DATABASE_POOLER=transaction.",
    )
    database_pooler: Pooler = Field(
        default=Pooler.NONE,
        description="`transaction` when AQ_DATABASE_URL is PgBouncer in transaction mode: the "
        "pool sends no startup parameter and caches no prepared statement.",
    )
    core_url: str | None = Field(
        default=None, description="Base URL of Core; `simulator` for the in-process simulator."
    )
    core_callback_secret: SecretStr | None = Field(
        default=None, description="HMAC secret of Core callbacks."
    )
    public_url: str | None = Field(
        default=None, description="URL Core calls back; default http://HOST:PORT."
    )
    jwt_secret: SecretStr | None = Field(default=None, description="HS256 secret for user tokens.")
    jwt_issuer: str = Field(
        default="", description="When set, user tokens must carry this `iss` (and are minted so)."
    )
    jwt_audience: str = Field(
        default="", description="When set, user tokens must carry this `aud` (and are minted so)."
    )
    jwt_max_ttl_s: float = Field(
        default=24 * 3600.0,
        gt=0,
        description="The longest lifetime a user token may have: `exp - iat`, or `exp - now` "
        "for a token without `iat`; a longer one is refused (401), and `token --ttl` cannot "
        "mint one.",
    )
    admin_token: SecretStr | None = Field(default=None, description="Bearer token of admin calls.")
    metrics_token: SecretStr | None = Field(
        default=None,
        description="When set, `/metrics` requires `Authorization: Bearer` with it (401 "
        "otherwise). Optional, never generated: a scraper inside the network may go without.",
    )
    metrics_cache_s: float = Field(
        default=5.0,
        ge=0,
        description="`/metrics` reads its database gauges at most once per this many seconds, "
        "however often it is scraped; 0 reads them on every scrape.",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A new connection must deliver a complete request head (line and headers) "
        "within this, or it is closed: an idle or dribbling socket holds nothing for long.",
    )
    keepalive_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description="A kept-alive connection must start and deliver its next request head "
        "within this after a response, or it is closed. Behind a proxy that reuses "
        "connections, set it above the proxy's idle timeout.",
    )
    max_connections: int | None = Field(
        default=None,
        ge=1,
        description="Client connections one instance holds at once; past it a new one is "
        "answered 503 (or /healthz) and closed, past a small lane for that, closed at accept. "
        "Default: what the file-descriptor limit leaves after the database pool, the LISTEN "
        "connection, Core's connections and files, at most 10,000.",
    )
    body_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Reading a request's body (at most 1 MiB) must end within this after its "
        "head; past it the answer is 408 and the connection is closed.",
    )
    sweep_interval_s: float = Field(default=30.0, ge=0.0, description="0 disables the sweep.")
    release_window_s: float = Field(default=1800.0, gt=0)
    global_max_running: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="Provider ceiling: runs judging in Core at once, across users and instances; "
        "0 = off. Applied to the database at start (the last instance started wins).",
    )
    analysis_cost: int = Field(default=1, ge=0)
    recheck_cost: int = Field(default=0, ge=0)
    job_max_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        le=1024 * 1024,
        description="What one job may store, thesis and sources together (UTF-8 JSON bytes).",
    )
    data_dir: Path = Field(default_factory=default_data_dir)

    # Tuning knobs; the defaults are what production wants.
    listen_enabled: bool = Field(default=True, description="Off only to test the sweep alone.")
    pool_min_size: int = Field(default=2, ge=1)
    pool_max_size: int = Field(default=10, ge=1)
    event_streams_per_user: int = Field(
        default=20, ge=1, description="Event streams one user may have open on an instance."
    )
    event_streams_max: int = Field(
        default=5000, ge=1, description="Event streams open on an instance, all users."
    )
    event_stream_max_s: float = Field(
        default=1800.0, gt=0, description="A stream ends after this; the client resumes."
    )
    db_acquire_timeout_s: float = Field(
        default=5.0, gt=0, description="How long a query waits for a pooled connection; then 503."
    )
    db_statement_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="How long a statement may take, lock waits included; then it is cancelled "
        "and the request answers 503.",
    )
    dispatch_concurrency: int = Field(default=32, ge=1)
    release_backoff_base_s: float = Field(default=1.0, gt=0)
    release_backoff_max_s: float = Field(default=60.0, gt=0)
    claim_lease_s: float = Field(default=60.0, gt=0)
    running_quiet_s: float = Field(default=60.0, gt=0, description="Poll Core after this.")
    reservation_stale_s: float = Field(default=120.0, gt=0)
    listener_ping_s: float = Field(default=5.0, gt=0)
    shutdown_timeout_s: float = Field(default=10.0, gt=0)
    startup_timeout_s: float = Field(
        default=30.0, gt=0, description="How long a start waits for an unreachable database."
    )
    core_timeout_s: float = Field(default=10.0, gt=0)
    sim_judge_time_s: float = Field(default=2.0, ge=0, description="Simulator judging time.")
    instance_id: str = Field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}")
    log_level: str = "INFO"

    def with_generated_secrets(self) -> Settings:
        """Development only: fill empty secrets from DATA_DIR/secrets.json, creating it on first
        use, so that a restart, ``token`` and ``token --admin`` agree with the running server."""
        missing = [name for name in SECRET_NAMES if getattr(self, name) is None]
        if not missing:
            return self
        path = self.data_dir / SECRETS_FILE
        stored: dict[str, str] = {}
        if path.exists():
            stored = json.loads(path.read_text())
        changed = False
        for name in missing:
            if name not in stored:
                stored[name] = secrets.token_urlsafe(32)
                changed = True
        if changed:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.unlink(missing_ok=True)
            # Created 0600: the secrets are never readable by others, not even briefly.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(stored, indent=2))
            tmp.replace(path)
        return self.model_copy(update={name: SecretStr(stored[name]) for name in missing})

    def for_development(self) -> Settings:
        """The development stand-ins for whatever is not set: the embedded database, the Core
        simulator, generated secrets."""
        update = {
            "database_url": self.database_url or EMBEDDED,
            "core_url": self.core_url or SIMULATOR,
        }
        return self.model_copy(update=update).with_generated_secrets()

    def secret(self, name: str) -> str:
        """A secret's value ("" when unset: it then verifies nothing)."""
        value: SecretStr | None = getattr(self, name)
        return value.get_secret_value() if value is not None else ""

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # Secrets are SecretStr; a database URL may carry a password of its own.
        for name, value in super().__repr_args__():
            yield name, safe_dsn(value) if name in _DSN_FIELDS and value else value

    @property
    def direct_url(self) -> str | None:
        """The URL of the connections that need a session: the direct one, else the pool's."""
        return self.direct_database_url or self.database_url

    @property
    def mode(self) -> Mode:
        stand_in = self.database_url == EMBEDDED or self.core_url == SIMULATOR
        return Mode.DEVELOPMENT if stand_in else Mode.PRODUCTION

    @property
    def callback_base_url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def missing_for_serve(settings: Settings) -> list[str]:
    """The variables ``serve`` cannot start without: the database, Core, the three secrets, and
    behind a transaction pooler the direct database URL (:data:`REQUIRED_BECAUSE`)."""
    required: tuple[str, ...] = ("database_url", "core_url", *SECRET_NAMES)
    if settings.database_pooler is Pooler.TRANSACTION:
        required = (*required[:1], "direct_database_url", *required[1:])
    return [env_name(name) for name in required if not getattr(settings, name)]


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """``AQ_`` variables that are no setting (pydantic-settings would ignore them silently), each
    with the setting it looks like: "AQ_DATABSE_URL: unknown setting; did you mean ...?"."""
    known = {env_name(name) for name in Settings.model_fields}
    problems = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known or upper in TOOLING_VARIABLES:
            continue
        guess = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {guess[0]}?" if guess else ""
        problems.append(f"{name}: unknown setting{hint}")
    return problems


def safe_dsn(dsn: str) -> str:
    """A database URL fit for a log line: the password removed."""
    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn
    host = parts.hostname or ""
    netloc = f"{parts.username}@{host}" if parts.username else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def dsn_address(dsn: str) -> str:
    """Where a database URL points, for messages: host:port (or the socket directory)."""
    parts = urlsplit(dsn)
    host = parts.hostname or parse_qs(parts.query).get("host", ["localhost"])[0]
    return f"{host}:{parts.port or 5432}"
