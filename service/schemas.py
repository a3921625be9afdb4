"""Request bodies: pydantic models that forbid unknown fields and bound every size.

Semantic validation of sources and the thesis document (DOI shape, parseability) is Core's
job at create time; these models check shape and size so nothing unbounded reaches Core or the
database.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

MAX_SOURCES = 200
Text = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=500)]
Url = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=2000)]
Source = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=2000)]
UserId = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Thesis(_Strict):
    title: Text
    document_url: Url


class AnalysisRequest(_Strict):
    thesis: Thesis
    sources: list[Source] = Field(min_length=1, max_length=MAX_SOURCES)


class RecheckRequest(_Strict):
    sources: list[Source] = Field(min_length=1, max_length=MAX_SOURCES)


class CreditGrant(_Strict):
    user_id: UserId
    amount: int = Field(gt=0, le=1_000_000)
    note: str | None = Field(default=None, max_length=500)
