"""The dashboard is static files, with no inline script."""

from __future__ import annotations

from pathlib import Path

from analysis_queue.http import dashboard

STATIC = Path(__file__).resolve().parents[3] / "service" / "analysis_queue" / "http" / "static"


def test_the_dashboard_is_static_and_uses_no_inline_script() -> None:
    html = (STATIC / "index.html").read_text()
    assert '<script src="/static/app.js" defer></script>' in html
    assert html.count("<script") == 1 and "style=" not in html
    script = (STATIC / "app.js").read_text()
    assert "setInterval" not in script and "innerHTML" not in script
    assert "new EventSource(" in script


def test_the_page_names_its_own_icon_and_it_is_served() -> None:
    # Without a declared icon a browser asks for /favicon.ico, a 404 on every load.
    html = (STATIC / "index.html").read_text()
    assert '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">' in html
    assert dashboard.CONTENT_TYPES["favicon.svg"] == "image/svg+xml"
    assert (STATIC / "favicon.svg").read_text().startswith("<svg ")
