"""The playground in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`, which scripts/setup.sh installs) driven by selenium against the shared real
servers. Digits from the demo model must render as images; a chat with the tiny text model
(behind an API key, typed into the page) must stream its text in. Screenshots are kept in
$OMNISTAGE_TEST_ARTIFACTS (else a pytest temporary folder); where Chromium, its driver or
selenium is missing, the tests skip naming what is."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

    from tests.entrypoints.openai.conftest import Server

WAIT_S = 30          # every wait on the page has this deadline
PAGE_LOAD_S = 20


def _missing() -> list[str]:
    missing = [] if importlib.util.find_spec("selenium") else ["selenium (pip)"]
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        missing.append("chromium (apt)")
    if not shutil.which("chromedriver"):
        missing.append("chromium-driver (apt)")
    return missing


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("OMNISTAGE_TEST_ARTIFACTS")
    if folder is None:
        return tmp_path_factory.mktemp("playground-screenshots")
    path = Path(folder) / "playground"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    missing = _missing()
    if missing:
        pytest.skip(f"no headless browser: {', '.join(missing)} not installed "
                    "(scripts/setup.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1000,760", "--force-device-scale-factor=1",
                "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options,
                              service=Service(executable_path=shutil.which("chromedriver")))
    try:
        driver.set_page_load_timeout(PAGE_LOAD_S)
        driver.set_script_timeout(WAIT_S)
        yield driver
    finally:
        driver.quit()     # ends chromedriver and every Chromium process it started


def wait(driver: WebDriver, what: str, condition) -> object:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(
        condition, message=f"{what}: not within {WAIT_S} s")


def open_page(driver: WebDriver, server: Server) -> None:
    driver.get(f"{server.url}/")
    driver.execute_script("localStorage.clear()")
    driver.refresh()


def test_digits_render_in_the_images_tab(browser: WebDriver, image_server: Server,
                                         artifacts: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    open_page(browser, image_server)
    wait(browser, "model loaded", lambda d: d.find_element(By.TAG_NAME, "body")
         .get_attribute("data-ready") == "true")
    # the demo makes images only: the images tab alone, selected
    tabs = [t for t in browser.find_elements(By.CSS_SELECTOR, '[role="tab"]') if t.is_displayed()]
    assert [t.text for t in tabs] == ["Images"]
    assert tabs[0].get_attribute("aria-selected") == "true"
    for field, value in (("images-seed", "3"), ("images-n", "4")):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    prompt = browser.find_element(By.ID, "images-prompt")
    prompt.clear()
    prompt.send_keys("a handwritten 7", Keys.ENTER)          # Enter submits the form
    rendered = """return [...document.querySelectorAll('#images-grid img')]
                  .map(i => i.complete ? i.naturalWidth : 0)"""
    widths = wait(browser, "four rendered images",
                  lambda d: (w := d.execute_script(rendered)) and len(w) == 4 and all(w) and w)
    assert widths == [64, 64, 64, 64]
    assert "per image" in browser.find_element(By.ID, "images-metrics").text
    browser.save_screenshot(str(artifacts / "playground-digits.png"))


def test_a_chat_streams_in_with_the_api_key(browser: WebDriver, text_server: Server,
                                            artifacts: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    open_page(browser, text_server)
    # without the key /v1/models is refused: the page asks for it, then loads the model
    wait(browser, "the key asked for", lambda d: "API key" in d.find_element(By.ID, "status").text)
    browser.find_element(By.ID, "api-key").send_keys(text_server.api_key, Keys.ENTER)
    wait(browser, "model loaded", lambda d: d.find_element(By.TAG_NAME, "body")
         .get_attribute("data-ready") == "true")
    assert browser.find_element(By.ID, "model-name").text == "tiny-chat"
    tabs = [t.text for t in browser.find_elements(By.CSS_SELECTOR, '[role="tab"]')
            if t.is_displayed()]
    assert tabs == ["Chat"]
    tokens = browser.find_element(By.ID, "chat-max-tokens")
    tokens.clear()
    tokens.send_keys("24")
    box = browser.find_element(By.ID, "chat-input")
    box.send_keys("Tell me about digits", Keys.ENTER)        # Enter sends
    answer = wait(browser, "the streamed answer", lambda d: d.find_element(
        By.CSS_SELECTOR, '.msg.assistant[data-done="true"]'))
    assert "error" not in answer.get_attribute("class"), answer.text
    assert answer.text.strip()
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "Tell me about digits"
    metrics = browser.find_element(By.ID, "chat-metrics").text
    assert "first token" in metrics and "tokens/s" in metrics, metrics
    assert box.get_attribute("value") == ""
    browser.save_screenshot(str(artifacts / "playground-chat.png"))
