"""The playground in a real browser (headless Chromium, the package's `browser` fixture) on
the shared real servers: digits from the demo model render as images; a chat with the tiny text
model, behind an API key typed into the page, streams its text in. Screenshots go to the
`screenshots` folder. The speech and video tabs are driven in test_speech.py and
test_videos.py, against their servers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from omnistage.testing.browser import open_playground, visible_tabs, wait_for

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

    from tests.system.entrypoints.openai.conftest import Server

RENDERED = """return [...document.querySelectorAll('#images-grid img')]
              .map(i => i.complete ? i.naturalWidth : 0)"""


def test_digits_render_in_the_images_tab(browser: WebDriver, image_server: Server,
                                         screenshots: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    open_playground(browser, image_server.url)
    assert visible_tabs(browser) == ["Images"]      # the demo makes images only
    tab = browser.find_element(By.ID, "tab-images")
    assert tab.get_attribute("aria-selected") == "true"
    for field, value in (("images-seed", "3"), ("images-n", "4")):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    prompt = browser.find_element(By.ID, "images-prompt")
    prompt.clear()
    prompt.send_keys("a handwritten 7", Keys.ENTER)          # Enter submits the form
    widths = wait_for(browser, "four rendered images", lambda d: (
        (w := d.execute_script(RENDERED)) and len(w) == 4 and all(w) and w))
    assert widths == [64, 64, 64, 64]
    assert "per image" in browser.find_element(By.ID, "images-metrics").text
    assert not browser.find_element(By.ID, "images-working").is_displayed()
    # an unselected tab's label is dark on the light page (tabs are buttons, whose text was
    # white: the labels were barely visible)
    colors = browser.execute_script("""return ['tab-chat', 'tab-images'].map(
        id => getComputedStyle(document.getElementById(id)).color)""")
    assert "rgb(255, 255, 255)" not in colors, colors
    browser.save_screenshot(str(screenshots / "playground-digits.png"))


def test_a_chat_streams_in_with_the_api_key(browser: WebDriver, text_server: Server,
                                            screenshots: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    open_playground(browser, text_server.url)
    # without the key /v1/models is refused: the page asks for it, then loads the model
    assert "API key" in browser.find_element(By.ID, "status").text
    assert browser.switch_to.active_element.get_attribute("id") == "api-key"
    browser.switch_to.active_element.send_keys(text_server.api_key, Keys.ENTER)
    wait_for(browser, "the model loaded", lambda d: d.execute_script(
        "return document.body.dataset.ready === 'true'"))
    assert browser.find_element(By.ID, "model-name").text == "tiny-chat"
    assert visible_tabs(browser) == ["Chat"]
    tokens = browser.find_element(By.ID, "chat-max-tokens")
    tokens.clear()
    tokens.send_keys("24")
    box = browser.find_element(By.ID, "chat-input")
    box.send_keys("Tell me about digits", Keys.ENTER)        # Enter sends
    answer = wait_for(browser, "the streamed answer", lambda d: d.find_element(
        By.CSS_SELECTOR, '.msg.assistant[data-done="true"]'))
    assert "error" not in answer.get_attribute("class"), answer.text
    assert answer.text.strip()
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "Tell me about digits"
    metrics = browser.find_element(By.ID, "chat-metrics").text
    assert "first token" in metrics and "tokens/s" in metrics, metrics
    assert box.get_attribute("value") == ""
    browser.save_screenshot(str(screenshots / "playground-chat.png"))
