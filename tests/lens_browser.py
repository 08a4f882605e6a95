"""Headless Chromium for the entropy lens tests (tests/test_lens.py): finding and starting
it, and the few page actions the tests repeat. Like serving.py, a helper, not a test."""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

H_MAX = 6.0  # tokens.js: the colour ramp's top
STOPS = [(0.0, (224, 236, 255)), (0.25, (190, 235, 200)), (0.5, (255, 240, 150)),
         (0.75, (255, 190, 110)), (1.0, (245, 120, 120))]
NO_CHROMIUM = ("no Chromium here: install Debian's `chromium` and `chromium-driver` (as "
               ".ci/run does) to run the browser tests")


def entropy_colour(h: float) -> tuple[float, float, float]:
    """tokens.js's entropyColour, recomputed here from the API's numbers."""
    t = min(max(h / H_MAX, 0.0), 1.0)
    i = 1
    while i < len(STOPS) - 1 and t > STOPS[i][0]:
        i += 1
    (t0, c0), (t1, c1) = STOPS[i - 1], STOPS[i]
    f = (t - t0) / (t1 - t0)
    return tuple(c + f * (d - c) for c, d in zip(c0, c1))


def chromium_paths() -> tuple[str, str] | None:
    """(browser, chromedriver), or None when either is missing."""
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser",
                                                   "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def start_chromium(downloads: Path):
    """A headless Chromium under selenium, saving downloads to `downloads`; skips the
    calling test when there is no Chromium or no selenium."""
    found = chromium_paths()
    if found is None:
        pytest.skip(NO_CHROMIUM)
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = found[0]
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1280,900", "--disable-extensions"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(found[1]), options=opts)
    d.downloads = downloads
    d.execute_cdp_cmd("Page.setDownloadBehavior",
                      {"behavior": "allow", "downloadPath": str(downloads)})
    return d


def by(d, css):
    from selenium.webdriver.common.by import By
    return d.find_elements(By.CSS_SELECTOR, css)


def wait_for(pred, timeout=60.0, what="condition"):
    deadline = time.time() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def open_page(d, base: str, key: str | None, view: str = "playground") -> None:
    """Load the page afresh (no key remembered), type `key` if any, and start recording
    the bodies the page POSTs in window.__sent (the page calls the global fetch)."""
    d.get(base + "/")
    d.execute_script("sessionStorage.clear()")
    d.get("about:blank")
    d.get(f"{base}/#{view}")
    wait_for(lambda: by(d, "#pg-temperature"), 10, "the page's controls")
    if key:
        fill(d, "api-key", key)
        by(d, "#key-form button")[0].click()
        wait_for(lambda: "model:" in by(d, "#server-status")[0].text, 10, "the model's name")
    d.execute_script("""
        window.__sent = [];
        window.__realFetch = window.__realFetch || window.fetch;
        window.fetch = (url, opts = {}) => {
          if (opts.method === 'POST') window.__sent.push({url, body: JSON.parse(opts.body)});
          return window.__realFetch(url, opts);
        };""")


def fill(d, element_id: str, value) -> None:
    el = by(d, "#" + element_id)[0]
    el.clear()
    el.send_keys(str(value))


def send(d, prompt: str, max_tokens: int = 8, temperature: float | None = None):
    """Send `prompt` from the playground; returns the answer's element once it has ended."""
    fill(d, "pg-max_tokens", max_tokens)
    if temperature is not None:
        fill(d, "pg-temperature", temperature)
    fill(d, "pg-prompt", prompt)
    n = len(by(d, "#pg-transcript .turn"))
    by(d, "#pg-send")[0].click()
    wait_for(lambda: len(by(d, "#pg-transcript .turn")) >= n + 2, 10, "the answer's bubble")
    wait_for(lambda: by(d, "#pg-send")[0].is_enabled(), 60, "the answer to end")
    return by(d, "#pg-transcript .turn.assistant .answer")[-1]


def text_of(d, css: str) -> str | None:
    """The text of the first element matching `css`, read in one step (no stale handle)."""
    return d.execute_script("const e = document.querySelector(arguments[0]);"
                            "return e ? e.textContent : null", css)


def rgb(css: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", css)[:3])
