"""Settings, read from the environment with the ``AQ_`` prefix (pydantic-settings).

Every setting has a default that runs the whole service on a fresh machine: no database URL
means an embedded PostgreSQL under ``DATA_DIR``, no Core URL means the Core simulator in-process,
no secrets means secrets generated once and kept in ``DATA_DIR/secrets.json``.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

SECRETS_FILE = "secrets.json"


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "analysis-queue"


class Settings(BaseSettings):
    """The service's configuration. Env: ``AQ_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="AQ_", extra="ignore", frozen=True)

    database_url: str | None = Field(
        default=None, description="PostgreSQL DSN; unset starts an embedded server in DATA_DIR."
    )
    core_url: str | None = Field(
        default=None, description="Base URL of Core; unset runs the Core simulator in-process."
    )
    core_callback_secret: str = Field(default="", description="HMAC secret of Core callbacks.")
    public_url: str | None = Field(
        default=None, description="URL Core calls back; default http://HOST:PORT."
    )
    jwt_secret: str = Field(default="", description="HS256 secret for user tokens.")
    jwt_issuer: str = Field(
        default="", description="When set, user tokens must carry this `iss` (and are minted so)."
    )
    jwt_audience: str = Field(
        default="", description="When set, user tokens must carry this `aud` (and are minted so)."
    )
    admin_token: str = Field(default="", description="Bearer token of admin calls.")
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
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
    data_dir: Path = Field(default_factory=default_data_dir)

    # Tuning knobs; the defaults are what production wants.
    listen_enabled: bool = Field(default=True, description="Off only to test the sweep alone.")
    pool_min_size: int = Field(default=2, ge=1)
    pool_max_size: int = Field(default=10, ge=1)
    dispatch_concurrency: int = Field(default=32, ge=1)
    release_backoff_base_s: float = Field(default=1.0, gt=0)
    release_backoff_max_s: float = Field(default=60.0, gt=0)
    claim_lease_s: float = Field(default=60.0, gt=0)
    running_quiet_s: float = Field(default=60.0, gt=0, description="Poll Core after this.")
    reservation_stale_s: float = Field(default=120.0, gt=0)
    listener_ping_s: float = Field(default=5.0, gt=0)
    shutdown_timeout_s: float = Field(default=10.0, gt=0)
    core_timeout_s: float = Field(default=10.0, gt=0)
    sim_judge_time_s: float = Field(default=2.0, ge=0, description="Simulator judging time.")
    instance_id: str = Field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}")
    log_level: str = "INFO"

    def with_generated_secrets(self) -> Settings:
        """Fill empty secrets from DATA_DIR/secrets.json, creating it on first use."""
        missing = [
            name
            for name in ("jwt_secret", "admin_token", "core_callback_secret")
            if not getattr(self, name)
        ]
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
        return self.model_copy(update={name: stored[name] for name in missing})

    @property
    def callback_base_url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"
