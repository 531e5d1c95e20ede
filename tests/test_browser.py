"""One end-to-end run of the studio page in a real headless Chromium (Debian's `chromium` driven by the
`playwright` package; no browser is ever downloaded): type a prompt, watch the reasoning stream and the
steps tick, get the final PNG."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from studio_fixtures import engine_server, studio, wait_for  # noqa: F401

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
if CHROMIUM is None:
    pytest.skip("Debian chromium is not installed (apt-get install -y chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                                                             "(pip install playwright; no browser download needed)")

pytestmark = pytest.mark.slow

# Flags for a sandboxed, offline machine: no first-run UI, no calls to Google's services.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Records every value the status box takes, so the test can see the stream, not only its end.
RECORD_STATUS = """
() => {
  window.__statuses = [];
  const box = () => document.querySelector('#status textarea');
  setInterval(() => {
    const b = box(); if (!b) return;
    const v = b.value, s = window.__statuses;
    if (s.length === 0 || s[s.length - 1] !== v) s.push(v);
  }, 10);
}
"""


def open_page(browser, url: str):
    """A page whose app has loaded and wired its events (a click before that is lost)."""
    page = browser.new_page()
    page.goto(url, wait_until="networkidle")
    sync_api.expect(page.locator("#run")).to_be_visible()
    return page


def run_without_reasoning(page, prompt: str, steps: int):
    """Type a prompt, reasoning Off (straight to the steps), set the steps, Generate; the status box."""
    page.locator("#prompt textarea").fill(prompt)
    page.locator("#mode label", has_text="Off").click()
    box = page.locator("#steps input[type=number]")
    box.fill(str(steps))
    box.press("Enter")
    page.locator("#run").click()
    return page.locator("#status textarea")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)   # a fresh temporary profile each time
        yield b
        b.close()


def test_page_streams_reasoning_steps_and_the_final_image(browser, studio):
    url, counting, _ = studio
    expect = sync_api.expect
    external = []
    page = browser.new_page()
    page.on("request", lambda r: None if r.url.startswith(url.rstrip("/")) or r.url.startswith("data:")
            else external.append(r.url))
    page.goto(url, wait_until="networkidle")
    page.locator("#prompt textarea").fill("a red circle on a white table")
    steps = page.locator("#steps input[type=number]")
    steps.fill("3")
    steps.press("Enter")
    page.evaluate(RECORD_STATUS)
    page.locator("#run").click()

    cot = page.locator("#cot textarea")
    try:
        expect(cot).to_have_value(re.compile(r"\[Thinking\]\n.+", re.S), timeout=60_000)
    except AssertionError:          # say what the page and the engine were doing
        print("statuses seen:", page.evaluate("window.__statuses"), "requests:", len(counting.submitted),
              "engine:", counting.health())
        raise
    expect(page.locator("#status textarea")).to_have_value(re.compile(r"^Done"), timeout=60_000)
    src = page.locator("#result img").get_attribute("src")
    assert src, "no final image"
    resp = page.request.get(src)
    assert resp.ok and resp.headers["content-type"] == "image/png"
    assert resp.body()[:8] == b"\x89PNG\r\n\x1a\n"

    seen = page.evaluate("window.__statuses")
    writing = [i for i, s in enumerate(seen) if s.startswith("Writing")]
    stepping = [i for i, s in enumerate(seen) if s.startswith("step ")]
    done = [i for i, s in enumerate(seen) if s.startswith("Done")]
    assert writing and stepping and done, seen
    assert writing[0] < stepping[0] < done[0], seen
    assert counting.submitted[-1].steps == 3          # what was typed is what ran
    assert not external, f"the page reached outside the server: {external[:5]}"
    page.close()


def test_empty_prompt_is_refused_on_the_page(browser, studio):
    url, counting, _ = studio
    before = len(counting.submitted)
    page = open_page(browser, url)
    page.locator("#run").click()
    sync_api.expect(page.get_by_text(re.compile("prompt is empty", re.I)).first).to_be_visible(timeout=20_000)
    assert len(counting.submitted) == before
    page.close()


def test_stop_button_stops_the_engine_and_the_page_runs_again(browser, studio, engine_server):
    url, counting, _ = studio
    expect = sync_api.expect
    page = open_page(browser, url)
    status = run_without_reasoning(page, "a very long one", 100)
    steps = page.locator("#steps input[type=number]")
    expect(status).to_have_value(re.compile(r"^step \d+/100"), timeout=60_000)
    page.locator("#stop").click()
    expect(status).to_have_value("Stopped.", timeout=30_000)
    wait_for(lambda: engine_server.health()["state"] == "ready", 30)     # the engine itself stopped
    steps.fill("2")
    steps.press("Enter")
    page.locator("#run").click()
    expect(status).to_have_value(re.compile(r"^Done"), timeout=60_000)
    assert counting.submitted[-1].steps == 2 and counting.submitted[-1].bot_task == "image"
    page.close()


def test_edit_this_result_makes_the_result_the_reference(browser, studio):
    """Generate, press 'Edit this result', give an instruction: the edit runs on the result image."""
    url, counting, _ = studio
    expect = sync_api.expect
    page = open_page(browser, url)
    page.locator("#edit-result").click()                     # nothing generated yet: a message, no change
    expect(page.get_by_text(re.compile("Generate an image first", re.I)).first).to_be_visible(timeout=20_000)
    status = run_without_reasoning(page, "a blue square", 2)
    expect(status).to_have_value(re.compile(r"^Done"), timeout=60_000)
    result_src = page.locator("#result img").get_attribute("src")
    page.locator("#edit-result").click()
    expect(page.locator("#ti2i-prompt textarea")).to_be_visible(timeout=20_000)     # the edit tab opened
    expect(page.locator("#refs img")).to_have_count(1, timeout=20_000)
    page.locator("#ti2i-prompt textarea").fill("make it red")
    before = len(counting.submitted)
    page.locator("#ti2i-run").click()
    wait_for(lambda: len(counting.submitted) > before, 60)     # the status still says the last run's Done
    expect(status).to_have_value(re.compile(r"^Done"), timeout=60_000)
    req = counting.submitted[-1]
    assert req.prompt == "make it red" and len(req.images) == 1, req
    with open(req.images[0], "rb") as f:                      # the reference is the result's PNG
        ref = f.read()
    assert page.request.get(result_src).body() == ref
    page.close()


def test_a_finished_run_joins_the_history_and_shows_its_seed(browser, studio):
    """Each finished image goes to the page's history (newest first); the seed box shows the (random)
    seed it used, so unticking "Random seed" draws it again."""
    url, counting, _ = studio
    expect = sync_api.expect
    page = open_page(browser, url)
    for i, prompt in enumerate(("a green circle", "a yellow star")):
        before = len(counting.submitted)
        status = run_without_reasoning(page, prompt, 2)
        wait_for(lambda: len(counting.submitted) > before, 60)
        expect(status).to_have_value(re.compile(r"^Done"), timeout=60_000)
        expect(page.locator("#history img")).to_have_count(i + 1, timeout=20_000)
    imgs = page.locator("#history img")
    assert [imgs.nth(k).get_attribute("alt") for k in range(2)] == ["a yellow star", "a green circle"]  # newest first
    used = counting.submitted[-1].seed
    expect(page.locator("#seed input")).to_have_value(str(used), timeout=20_000)
    page.locator("#random-seed input").uncheck()
    before = len(counting.submitted)
    status = run_without_reasoning(page, "a yellow star", 2)
    wait_for(lambda: len(counting.submitted) > before, 60)
    assert counting.submitted[-1].seed == used
    expect(status).to_have_value(re.compile(r"^Done"), timeout=60_000)
    page.close()
