"""Settings: what production refuses to start without, names that are no setting, secrets
generated once for development and never shown."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from analysis_queue.config import (
    EMBEDDED,
    REQUIRED_BECAUSE,
    SECRETS_FILE,
    SIMULATOR,
    Mode,
    Pooler,
    Settings,
    dsn_address,
    missing_for_serve,
    safe_dsn,
    unknown_variables,
)

SECRET_NAMES = ("jwt_secret", "admin_token", "core_callback_secret")
COMPLETE = {
    "database_url": "postgresql://aq:hunter2@db.internal:6432/aq",
    "core_url": "http://core:8090",
    "jwt_secret": "j" * 32,
    "admin_token": "admin-token",
    "core_callback_secret": "callback-secret",
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in Settings.model_fields:
        monkeypatch.delenv(f"AQ_{name.upper()}", raising=False)


def _secrets(settings: Settings) -> dict[str, str]:
    return {name: settings.secret(name) for name in SECRET_NAMES}


def test_generated_secrets_are_created_once_and_private(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = Settings(data_dir=data_dir).with_generated_secrets()
    path = data_dir / SECRETS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    values = _secrets(first)
    assert all(len(v) >= 32 for v in values.values())
    assert len(set(values.values())) == 3
    assert json.loads(path.read_text()) == values
    before = path.stat()

    second = Settings(data_dir=data_dir).with_generated_secrets()
    assert _secrets(second) == values
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not list(data_dir.glob("*.tmp"))


def test_explicit_secrets_are_kept(tmp_path: Path) -> None:
    stored = Settings(data_dir=tmp_path).with_generated_secrets()
    explicit = Settings(data_dir=tmp_path, jwt_secret="explicit-jwt").with_generated_secrets()
    assert explicit.secret("jwt_secret") == "explicit-jwt"
    assert explicit.secret("admin_token") == stored.secret("admin_token")
    assert explicit.secret("core_callback_secret") == stored.secret("core_callback_secret")
    assert json.loads((tmp_path / SECRETS_FILE).read_text())["jwt_secret"] == stored.secret(
        "jwt_secret"
    )

    all_set = Settings(
        data_dir=tmp_path / "unused", jwt_secret="a", admin_token="b", core_callback_secret="c"
    ).with_generated_secrets()
    assert _secrets(all_set) == {"jwt_secret": "a", "admin_token": "b", "core_callback_secret": "c"}
    assert not (tmp_path / "unused").exists()


def test_serve_names_everything_it_cannot_start_without() -> None:
    assert missing_for_serve(Settings()) == [
        "AQ_DATABASE_URL",
        "AQ_CORE_URL",
        "AQ_JWT_SECRET",
        "AQ_ADMIN_TOKEN",
        "AQ_CORE_CALLBACK_SECRET",
    ]
    assert missing_for_serve(Settings(**COMPLETE)) == []
    partial = {**COMPLETE, "admin_token": ""}
    assert missing_for_serve(Settings(**partial)) == ["AQ_ADMIN_TOKEN"], "empty is not set"


def test_a_transaction_pooler_needs_the_direct_url_too() -> None:
    behind = {**COMPLETE, "database_pooler": "transaction"}
    assert Settings(**behind).database_pooler is Pooler.TRANSACTION
    assert missing_for_serve(Settings(**behind)) == ["AQ_DIRECT_DATABASE_URL"]
    assert "LISTEN and migrations" in REQUIRED_BECAUSE["AQ_DIRECT_DATABASE_URL"]
    direct = "postgresql://aq:hunter3@db.internal:5432/aq"
    complete = Settings(**behind, direct_database_url=direct)
    assert missing_for_serve(complete) == []
    assert (complete.database_url, complete.direct_url) == (COMPLETE["database_url"], direct)
    # Without a pooler the direct URL defaults to the pool's.
    assert Settings(**COMPLETE).direct_url == COMPLETE["database_url"]
    assert unknown_variables({"AQ_DIRECT_DATABASE_URL": direct, "AQ_DATABASE_POOLER": "x"}) == []
    with pytest.raises(ValueError, match="database_pooler"):
        Settings(**COMPLETE, database_pooler="statement")


def test_the_metrics_token_is_optional_and_never_generated(tmp_path: Path) -> None:
    assert missing_for_serve(Settings(**COMPLETE)) == []  # no AQ_METRICS_TOKEN
    assert Settings(data_dir=tmp_path).for_development().metrics_token is None
    guarded = Settings(**COMPLETE, metrics_token="scrape-secret")
    assert guarded.secret("metrics_token") == "scrape-secret"
    assert "scrape-secret" not in repr(guarded) + str(guarded)


def test_development_stand_ins_are_asked_for_by_name(tmp_path: Path) -> None:
    production = Settings(**COMPLETE)
    assert production.mode is Mode.PRODUCTION
    dev = Settings(data_dir=tmp_path).for_development()
    assert (dev.database_url, dev.core_url, dev.mode) == (EMBEDDED, SIMULATOR, Mode.DEVELOPMENT)
    assert missing_for_serve(dev) == []
    # What is set stays: a real database with the simulator is still development.
    mixed = Settings(data_dir=tmp_path, database_url=COMPLETE["database_url"]).for_development()
    assert (mixed.database_url, mixed.core_url, mixed.mode) == (
        COMPLETE["database_url"],
        SIMULATOR,
        Mode.DEVELOPMENT,
    )


def test_no_secret_or_password_in_the_settings_repr() -> None:
    settings = Settings(**COMPLETE, direct_database_url="postgresql://aq:hunter3@db.internal/aq")
    shown = repr(settings) + str(settings)
    for secret in ("hunter2", "hunter3", COMPLETE["jwt_secret"], "admin-token", "callback-secret"):
        assert secret not in shown
    assert "postgresql://aq@db.internal:6432/aq" in shown
    assert "postgresql://aq@db.internal/aq" in shown


def test_a_misspelled_setting_is_named_with_what_it_looks_like() -> None:
    environ = {
        "AQ_DATABSE_URL": "postgresql://x",
        "AQ_CORE_URL": "http://core",  # a real one
        "AQ_TEST_DATABASE_URL": "postgresql://tests",  # the tests' own, not the service's
        "AQ_ZZZ": "1",
        "PATH": "/bin",
    }
    assert unknown_variables(environ) == [
        "AQ_DATABSE_URL: unknown setting; did you mean AQ_DATABASE_URL?",
        "AQ_ZZZ: unknown setting",
    ]


@pytest.mark.parametrize(
    ("dsn", "safe", "address"),
    [
        ("postgresql://u:pw@h:6432/db", "postgresql://u@h:6432/db", "h:6432"),
        ("postgresql://u@h/db", "postgresql://u@h/db", "h:5432"),
        ("postgresql://:pw@h/db?sslmode=require", "postgresql://h/db?sslmode=require", "h:5432"),
        ("postgresql:///db?host=/run/pg", "postgresql:///db?host=/run/pg", "/run/pg:5432"),
        ("postgresql:///db", "postgresql:///db", "localhost:5432"),
    ],
)
def test_database_urls_in_messages(dsn: str, safe: str, address: str) -> None:
    assert (safe_dsn(dsn), dsn_address(dsn)) == (safe, address)
