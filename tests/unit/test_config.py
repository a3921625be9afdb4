"""Settings: secrets generated once, kept private, explicit ones kept."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from analysis_queue.config import SECRETS_FILE, Settings

SECRET_NAMES = ("jwt_secret", "admin_token", "core_callback_secret")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SECRET_NAMES:
        monkeypatch.delenv(f"AQ_{name.upper()}", raising=False)


@pytest.mark.usefixtures("clean_env")
def test_generated_secrets_are_created_once_and_private(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = Settings(data_dir=data_dir).with_generated_secrets()
    path = data_dir / SECRETS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    values = {name: getattr(first, name) for name in SECRET_NAMES}
    assert all(len(v) >= 32 for v in values.values())
    assert len(set(values.values())) == 3
    assert json.loads(path.read_text()) == values
    before = path.stat()

    second = Settings(data_dir=data_dir).with_generated_secrets()
    assert {name: getattr(second, name) for name in SECRET_NAMES} == values
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not list(data_dir.glob("*.tmp"))


@pytest.mark.usefixtures("clean_env")
def test_explicit_secrets_are_kept(tmp_path: Path) -> None:
    stored = Settings(data_dir=tmp_path).with_generated_secrets()
    explicit = Settings(data_dir=tmp_path, jwt_secret="explicit-jwt").with_generated_secrets()
    assert explicit.jwt_secret == "explicit-jwt"
    assert explicit.admin_token == stored.admin_token
    assert explicit.core_callback_secret == stored.core_callback_secret
    assert json.loads((tmp_path / SECRETS_FILE).read_text())["jwt_secret"] == stored.jwt_secret

    all_set = Settings(
        data_dir=tmp_path / "unused", jwt_secret="a", admin_token="b", core_callback_secret="c"
    ).with_generated_secrets()
    assert (all_set.jwt_secret, all_set.admin_token, all_set.core_callback_secret) == (
        "a",
        "b",
        "c",
    )
    assert not (tmp_path / "unused").exists()
