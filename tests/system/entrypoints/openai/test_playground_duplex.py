"""The playground's Duplex tab in headless Chromium (its fake microphone: a beep) against a real
full-duplex server: `omnistage serve` of the tiny random Moshi (the released codec's 80 ms
frames) behind an API key, with room for one session only. The page shows the Duplex tab alone,
opens /v1/duplex with the key as a subprotocol, sends the microphone at 24 kHz while the
model's frames arrive and are scheduled for playback, counts ticks, frames, missed inputs and
tick latency live, shows no error, and Stop ends the session (session.ended with its stats);
the server then holds no session, and a second session starts in the freed (only) slot; while
another client holds that slot, Start shows the server's refusal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from omnistage.testing.browser import open_playground, visible_tabs, wait_for
from omnistage.testing.moshi_duplex import build_duplex_moshi

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

    from tests.system.entrypoints.openai.conftest import Server

MODEL, KEY = "moshi-tiny", "duplex-page-key"
GAUGE = ("omnistage_duplex_sessions", (("model_name", MODEL),))
COUNTERS = ("ticks", "frames", "missed-ticks", "missed-inputs")


@pytest.fixture(scope="module")
def duplex_server(start_server, tmp_path_factory: pytest.TempPathFactory) -> Server:
    path, _ = build_duplex_moshi(tmp_path_factory.mktemp("duplex-page") / "moshi")
    return start_server([str(path), "--served-model-name", MODEL, "--max-num-seqs", "1"],
                        api_key=KEY)


def counts(driver: WebDriver) -> dict[str, int]:
    return {name: int(driver.execute_script(
        f"return document.getElementById('dx-{name}').value")) for name in COUNTERS}


def no_error(driver: WebDriver) -> None:
    from selenium.webdriver.common.by import By

    shown = driver.find_element(By.ID, "status")
    assert "error" not in (shown.get_attribute("class") or ""), shown.text


def open_page(driver: WebDriver, server: Server) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    open_playground(driver, server.url)
    driver.find_element(By.ID, "api-key").send_keys(KEY, Keys.ENTER)
    wait_for(driver, "the model loaded", lambda d: d.execute_script(
        "return document.body.dataset.ready === 'true'"))


def run_session(driver: WebDriver, server: Server, num_ticks: int) -> tuple[dict, dict]:
    """Start, wait for `num_ticks` ticks, stop: the live counters and the ended ones."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "dx-start").click()
    state = driver.find_element(By.ID, "dx-state")
    wait_for(driver, "the session live", lambda d: state.text.startswith("live"))
    assert server.metrics()[GAUGE] == 1
    wait_for(driver, f"{num_ticks} ticks", lambda d: counts(d)["ticks"] >= num_ticks)
    live = counts(driver)
    assert live["frames"] >= num_ticks - 2, live        # a frame a tick from the second one
    # the frames go to Web Audio back to back: scheduled up to ahead of the clock
    ahead = driver.execute_script("return dx.player.next - dx.player.ctx.currentTime")
    assert 0 < ahead < 1.5, ahead
    assert "ms" in driver.find_element(By.ID, "dx-latency").text
    sent_s = float(driver.find_element(By.ID, "dx-sent").text.split()[0])
    assert sent_s > 0.3, sent_s                          # the microphone goes up
    no_error(driver)
    driver.find_element(By.ID, "dx-stop").click()
    wait_for(driver, "session.ended", lambda d: state.text == "ended (client_closed)")
    wait_for(driver, "the socket closed", lambda d: d.find_element(By.ID, "dx-start")
             .is_enabled())
    return live, counts(driver)


def test_a_duplex_session_in_the_browser(browser: WebDriver, duplex_server: Server,
                                         screenshots: Path) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, duplex_server)
    assert visible_tabs(browser) == ["Duplex"]           # no chat, no realtime turns
    assert browser.find_element(By.ID, "model-name").text == MODEL

    live, ended = run_session(browser, duplex_server, 25)
    # the final counts are the server's session.ended stats: at least the ticks seen live,
    # and the microphone heard on most of them (silence until it started, or on jitter)
    assert ended["ticks"] >= live["ticks"], (live, ended)
    heard = ended["ticks"] - ended["missed-inputs"]
    assert heard >= 8, ended
    summary = browser.find_element(By.ID, "dx-summary").text
    assert f"{ended['ticks']} ticks" in summary and "p99" in summary, summary
    browser.save_screenshot(str(screenshots / "playground-duplex.png"))
    no_error(browser)
    assert duplex_server.metrics()[GAUGE] == 0           # the slot freed at once

    # the server serves one session at most: a second one starts only in the freed slot
    run_session(browser, duplex_server, 5)
    no_error(browser)
    assert duplex_server.metrics()[GAUGE] == 0


def test_a_refused_session_is_shown(browser: WebDriver, duplex_server: Server) -> None:
    """Another client holds the only slot: Start shows the server's refusal, and the page can
    start again."""
    from selenium.webdriver.common.by import By
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{duplex_server.port}/v1/duplex?model={MODEL}",
                 additional_headers={"Authorization": f"Bearer {KEY}"},
                 open_timeout=30) as holder:
        assert json.loads(holder.recv(timeout=30))["type"] == "session.created"
        open_page(browser, duplex_server)
        browser.find_element(By.ID, "dx-start").click()
        shown = wait_for(browser, "the refusal", lambda d: "error" in (d.find_element(
            By.ID, "status").get_attribute("class") or "") and d.find_element(By.ID, "status"))
        assert "1013" in shown.text and "duplex sessions" in shown.text, shown.text
        wait_for(browser, "Start again", lambda d: d.find_element(By.ID, "dx-start")
                 .is_enabled())
        assert not browser.find_element(By.ID, "dx-stop").is_enabled()
