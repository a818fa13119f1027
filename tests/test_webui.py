"""The chat page at `/`, in a real browser: Debian's Chromium, headless, driven by selenium
through chromedriver, against a live server on the synthetic qwen3 model of
tests/test_server_responses.py (Qwen3's real template: it writes `<think>` blocks).

The page sends its "extra request fields" setting with each request, so a test forces a
scripted reply there (`logit_bias` +100 on a reply that is one special token, as the
server tests do) or a long one (`ignore_eos`). A screenshot of the conversation is kept
under pytest's temporary directory and its path printed (`pytest -s` shows it).

The browser tests skip, saying why, where Chromium, chromedriver or selenium is missing
(`apt-get install chromium chromium-driver`, `pip install selenium`); the page's files,
headers and `--no-webui` are checked without a browser.
"""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest

from eagerlm.service.http.server import ServerConfig, create_app
from eagerlm.service.http.webui import asset
from tests.test_server import LiveServer, wait_until
from tests.test_server_reasoning import ANSWER, END, THINK_REPLY, THOUGHT
from tests.test_server_responses import MARKDOWN_REPLY
from tests.test_server_responses import engine as engine  # the module-scoped model

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# flags that work in a container without a display, a GPU or the network
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1100,900")


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(create_app(engine, ServerConfig())) as s:
        yield s


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                    "(pip install selenium)")
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Chromium and chromedriver are not installed "
                    "(apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def by_id(driver, name: str):
    from selenium.webdriver.common.by import By
    return driver.find_element(By.ID, name)


def set_field(driver, name: str, value: str) -> None:
    """A settings field, as a user types it (the page saves on change)."""
    field = by_id(driver, name)
    driver.execute_script("arguments[0].value = arguments[1]; "
                          "arguments[0].dispatchEvent(new Event('change'))", field, value)


def send(driver, text: str) -> None:
    by_id(driver, "prompt").send_keys(text)
    by_id(driver, "send").click()


# What the page shows, read in one script (the page redraws a reply as it streams, so
# elements found one by one could be replaced in between).
_READ = """
const one = (m, s) => m.querySelector(s);
return {
  running: !document.getElementById("stop").hidden,
  model: document.getElementById("model").textContent,
  messages: [...document.querySelectorAll(".message")].map((m) => ({
    role: m.classList.contains("user") ? "user" : "assistant",
    text: (one(m, ".content") || m).innerText,
    stats: one(m, ".stats") ? one(m, ".stats").textContent : "",
    thought: one(m, ".thought") ? one(m, ".thought").textContent : null,
    folded: one(m, "details.thinking") ? !one(m, "details.thinking").open : null,
    strong: [...m.querySelectorAll("strong")].map((e) => e.textContent),
    python: [...m.querySelectorAll("pre code.language-python")].map((e) => e.textContent),
  })),
};
"""


def page(driver) -> dict:
    return driver.execute_script(_READ)


def replies_done(driver, n: int) -> bool:
    """n replies shown, the last one finished (its stats written) and the page ready."""
    shown = page(driver)
    replies = [m for m in shown["messages"] if m["role"] == "assistant"]
    return len(replies) == n and bool(replies[-1]["stats"]) and not shown["running"]


def last_reply(driver) -> dict:
    return [m for m in page(driver)["messages"] if m["role"] == "assistant"][-1]


def forcing(engine, script: str) -> str:
    return json.dumps({"logit_bias": {str(engine.tokenizer.token_id(script)): 100},
                       "stop": [END]})


def test_the_page_streams_replies_folds_thinking_renders_markdown_and_keeps_them(
        browser, server, engine, tmp_path_factory):
    browser.get(server.url + "/")
    wait_until(lambda: page(browser)["model"] == engine.name)

    set_field(browser, "custom", forcing(engine, THINK_REPLY))
    send(browser, "hello")
    wait_until(lambda: replies_done(browser, 1), 30)
    reply = last_reply(browser)
    assert reply["folded"] is True and reply["thought"].strip() == THOUGHT
    assert reply["text"] == ANSWER

    set_field(browser, "custom", forcing(engine, MARKDOWN_REPLY))
    send(browser, "show me code")
    wait_until(lambda: replies_done(browser, 2), 30)
    reply = last_reply(browser)
    assert reply["strong"] == ["bold"] and reply["python"] == ["print('hi')"]

    # a free reply of 12 tokens: its rate in tokens per second
    set_field(browser, "custom", json.dumps({"ignore_eos": True}))
    set_field(browser, "max_tokens", "12")
    send(browser, "count")
    wait_until(lambda: replies_done(browser, 3), 30)
    assert re.fullmatch(r"12 tokens · [0-9.]+ tok/s", last_reply(browser)["stats"])

    browser.refresh()  # the conversation is kept in the browser
    wait_until(lambda: len(page(browser)["messages"]) == 6)
    assert page(browser)["messages"][0] == {**page(browser)["messages"][0], "text": "hello"}
    shot = tmp_path_factory.mktemp("webui") / "chat-page.png"
    browser.save_screenshot(str(shot))
    print(f"\nscreenshot of the chat page: {shot}")
    assert shot.stat().st_size > 0


def test_stop_cancels_a_long_reply_in_the_engine(browser, server, engine):
    browser.get(server.url + "/")
    by_id(browser, "new-chat").click()
    set_field(browser, "custom", json.dumps({"ignore_eos": True}))
    set_field(browser, "max_tokens", "3500")
    cancelled = engine.dispatcher.service.stats.finished.get("cancelled", 0)
    send(browser, "go on forever")
    wait_until(lambda: page(browser)["running"] and last_reply(browser)["text"], 30)
    by_id(browser, "stop").click()
    wait_until(lambda: replies_done(browser, 1), 10)
    assert last_reply(browser)["stats"].startswith("stopped")
    wait_until(lambda: engine.dispatcher.service.stats.finished.get("cancelled", 0)
               > cancelled)
    wait_until(lambda: engine.active_requests == 0)


def test_the_page_fetches_nothing_from_outside_and_says_so_to_the_browser(server):
    r = httpx.get(server.url + "/", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for name in ("index.html", "chat.js", "chat.css"):
        text = asset(name).decode()
        # no URL to anywhere else: no scheme in a src, href, url() or fetch
        assert not re.search(r"""(src|href)=["']?(https?:)?//|url\(\s*["']?(https?:)?//|"""
                             r"""fetch\(\s*["'`](https?:)?//""", text), name
    for path in ("/webui/chat.js", "/webui/chat.css"):
        assert httpx.get(server.url + path, timeout=30).status_code == 200


def test_no_webui_leaves_the_page_out(engine):
    with LiveServer(create_app(engine, ServerConfig(webui=False))) as s:
        r = httpx.get(s.url + "/", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["message"]
        assert httpx.get(s.url + "/v1/models", timeout=30).status_code == 200
