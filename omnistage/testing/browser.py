"""Headless Chromium for the playground's browser tests: Debian's `chromium` and
`chromium-driver` (scripts/setup.sh --test installs them) driven by selenium (the test extras). Both
binaries are named to selenium, so its manager never looks for a browser to download."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

T = TypeVar("T")
WAIT_S = 30.0             # every wait on a page has this deadline
PAGE_LOAD_S = 20.0
OPTIONS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
           "--window-size=1000,760", "--force-device-scale-factor=1",
           "--autoplay-policy=no-user-gesture-required",
           # a microphone that beeps, allowed without asking (the realtime tab)
           "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream")


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing() -> list[str]:
    """What the browser tests lack, as the package to install (empty: nothing)."""
    lacking = [] if importlib.util.find_spec("selenium") else ["selenium (pip)"]
    if chromium_path() is None:
        lacking.append("chromium (apt)")
    if shutil.which("chromedriver") is None:
        lacking.append("chromium-driver (apt)")
    return lacking


@contextlib.contextmanager
def chromium() -> Iterator[WebDriver]:
    """A headless Chromium; on exit the driver and every browser process it started end."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium_path()
    for arg in OPTIONS:
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options,
                              service=Service(executable_path=shutil.which("chromedriver")))
    try:
        driver.set_page_load_timeout(PAGE_LOAD_S)
        driver.set_script_timeout(WAIT_S)
        yield driver
    finally:
        driver.quit()


def wait_for(driver: WebDriver, what: str, condition: Callable[[WebDriver], T],
             timeout_s: float = WAIT_S) -> T:
    """`condition`'s first truthy value, polled; TimeoutException naming `what` after the
    deadline."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # an element the page replaced while `condition` read it: read again at the next poll
    return WebDriverWait(driver, timeout_s, poll_frequency=0.1,
                         ignored_exceptions=(StaleElementReferenceException,)).until(
        condition, message=f"{what}: not within {timeout_s} s")


def open_playground(driver: WebDriver, url: str) -> None:
    """The page at `url` as a first visit (no key kept from an earlier test), waited on until
    it knows the model, unless the server asks for a key first."""
    driver.get(f"{url}/")
    driver.execute_script("localStorage.clear()")
    driver.refresh()
    wait_for(driver, "the page started", lambda d: d.execute_script(
        "return document.body.dataset.ready === 'true' || "
        "document.getElementById('status').textContent.includes('API key')"))


def visible_tabs(driver: WebDriver) -> list[str]:
    from selenium.webdriver.common.by import By

    return [t.text for t in driver.find_elements(By.CSS_SELECTOR, '[role="tab"]')
            if t.is_displayed()]
