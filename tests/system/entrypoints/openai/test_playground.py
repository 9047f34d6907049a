"""The playground page and the capabilities behind its tabs, on the shared real servers (no
browser: test_playground_browser.py drives one). The page needs no key where the APIs do; each
model's /v1/models card names the routes that serve it."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server


def test_the_page_is_served_without_the_key(text_server: Server) -> None:
    page = httpx.get(f"{text_server.url}/", timeout=10)
    assert page.status_code == 200 and "<title>omnistage playground</title>" in page.text
    script = httpx.get(f"{text_server.url}/playground/playground.js", timeout=10)
    assert script.status_code == 200 and "/v1/chat/completions" in script.text
    assert httpx.get(f"{text_server.url}/v1/models", timeout=10).status_code == 401


def test_capabilities_of_a_text_and_an_image_model(text_server: Server,
                                                   image_server: Server) -> None:
    text = text_server.get("/v1/models").json()["data"][0]
    assert text["capabilities"] == {"endpoints": ["/v1/chat/completions", "/v1/completions"],
                                    "input_modalities": ["text"]}
    image = image_server.get("/v1/models/omnistage-demo").json()
    assert image["capabilities"] == {
        "endpoints": ["/v1/chat/completions", "/v1/images/generations"],
        "input_modalities": ["text"]}


def test_a_missing_browser_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Chromium cannot be installed the browser tests skip naming the packages."""
    from omnistage.testing import browser

    monkeypatch.setattr(browser.shutil, "which", lambda name: None)
    assert browser.missing()[-2:] == ["chromium (apt)", "chromium-driver (apt)"]
    monkeypatch.setattr(browser.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert browser.missing() == ([] if importlib.util.find_spec("selenium")
                                 else ["selenium (pip)"])
