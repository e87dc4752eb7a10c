"""The live view at /dashboard (issue 59) in a real headless browser: Debian's Chromium driven by
Playwright (scripts/install.sh --test installs both). The server runs with --admin-api-key, so the
page's data endpoint needs it: the tests enter it as a user would (the page keeps it in the tab's
sessionStorage), and one test checks the endpoint refuses requests without it."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterator, List

import httpx
import pytest

from conftest import ServerProcess

ADMIN_KEY = "dash-admin-key"
POLL_TIMEOUT_MS = 30_000  # the page polls every second; a loaded CI machine may answer slowly
CHAT_MAX_TOKENS = 160


def find_chromium() -> str:
    for name in (os.environ.get("RADIXSERVE_CHROMIUM"), "chromium", "chromium-browser"):
        path = name and shutil.which(name)
        if path:
            return path
    message = "Chromium not found: apt-get install chromium (scripts/install.sh --test does), or set RADIXSERVE_CHROMIUM"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def dash_server() -> Iterator[ServerProcess]:
    srv = ServerProcess("--max-total-tokens", "6000", "--admin-api-key", ADMIN_KEY)
    yield srv
    assert srv.stop() == 0, srv.read_log()[-3000:]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = find_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: Chromium's sandbox refuses to run as root (CI and the dev machines are root)
        b = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def open_page(browser: Any, srv: ServerProcess, admin_key: str = ADMIN_KEY) -> Any:
    """A fresh tab on /dashboard; page.problems collects console errors and uncaught exceptions."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 1100})
    if admin_key:  # as if typed under Keys earlier in this tab
        ctx.add_init_script(f"sessionStorage.setItem('radixserve.adminKey', {json.dumps(admin_key)})")
    page = ctx.new_page()
    problems: List[str] = []
    page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
    page.problems = problems
    page.goto(srv.url + "/dashboard")
    return page


def wait_polls(page: Any, n: int = 2) -> None:
    """Until the page has rendered `n` more answers of /dashboard/state."""
    for _ in range(n):
        before = page.text_content("#updated")
        page.wait_for_function("t => document.getElementById('updated').textContent !== t", arg=before,
                               timeout=POLL_TIMEOUT_MS)
        page.wait_for_timeout(1100)  # the clock shows seconds: two polls within one look alike


def gauge(page: Any) -> dict:
    return page.eval_on_selector(".replica .kv-gauge", "g => Object.fromEntries(Object.entries(g.dataset).map(([k, v]) => [k, +v]))")


def plot(page: Any, name: str) -> dict:
    data = page.eval_on_selector(f"#plot-{name}", "c => ({...c.dataset})")
    return {k: float(v) if v not in ("", None) else None for k, v in data.items()}


def test_page_loads_without_console_errors(browser, dash_server):
    page = open_page(browser, dash_server)
    try:
        page.wait_for_function("document.getElementById('status').textContent === 'up'", timeout=POLL_TIMEOUT_MS)
        wait_polls(page, 2)
        assert page.problems == []
        assert page.is_hidden("#error")
        info = httpx.get(dash_server.url + "/get_server_info", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
        g = gauge(page)  # the KV gauge: every slot has one owner, and they add up to the pool
        assert g["private"] + g["protected"] + g["evictable"] + g["free"] == info["max_total_num_tokens"]
        assert page.text_content("#model").startswith(info["served_model_name"])
        assert page.locator("canvas.plot").count() == 6
    finally:
        page.context.close()


def test_chat_streams_an_answer_into_the_page(browser, dash_server):
    page = open_page(browser, dash_server)
    try:
        page.wait_for_function("document.getElementById('status').textContent === 'up'", timeout=POLL_TIMEOUT_MS)
        page.fill("#chat-temperature", "0")
        # long enough that the answer arrives over many reads of the stream, never in one
        page.fill("#chat-max-tokens", str(CHAT_MAX_TOKENS))
        # every text the answer's bubble shows while it streams
        page.evaluate("""() => {
            window.seen = [];
            new MutationObserver(() => {
                const t = document.querySelector('.msg.assistant .text');
                if (t && t.parentElement.dataset.state === 'streaming') window.seen.push(t.textContent);
            }).observe(document.getElementById('chat-log'), {subtree: true, childList: true, characterData: true});
        }""")
        page.fill("#chat-input", "Tell me a long story about a lighthouse.")
        page.press("#chat-input", "Enter")
        page.wait_for_selector(".msg.assistant[data-state=done]", timeout=120_000)
        answer = page.text_content(".msg.assistant .text")
        seen = [s for s in dict.fromkeys(page.evaluate("window.seen")) if s]
        # streamed: the bubble grew through several partial answers, each a prefix of the final one
        assert len(seen) >= 2, seen
        assert all(answer.startswith(s) for s in seen) and seen[-1] == answer
        # the model's own answer: the same request through the official client (greedy)
        import openai

        client = openai.OpenAI(base_url=dash_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ref = client.chat.completions.create(model=page.text_content("#model").split(" · ")[0], temperature=0,
                                             max_tokens=CHAT_MAX_TOKENS, messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}])
        assert answer == ref.choices[0].message.content
        meta = page.text_content(".msg.assistant .meta")
        assert f"/ {ref.usage.prompt_tokens} prompt tokens" in meta and "TTFT" in meta and "tok/s" in meta
        assert f"{ref.usage.completion_tokens} tokens" in meta
        assert page.problems == []
    finally:
        page.context.close()


def test_shared_prefix_burst_moves_hit_rate_plot_and_kv_gauge(browser, dash_server):
    page = open_page(browser, dash_server)
    try:
        wait_polls(page, 2)
        gauge_before, hit_before = gauge(page), plot(page, "hitrate")
        prefix = [(37 * i) % 900 + 10 for i in range(300)]
        with httpx.Client(base_url=dash_server.url, timeout=120) as http:
            for j in range(6):  # distinct first tokens after the prefix: the tree branches right after it
                r = http.post("/generate", json={"input_ids": prefix + [1000 + j, 1100 + j, 1200 + j],
                                                 "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
                assert r.status_code == 200, r.text
                assert r.json()["meta_info"]["cached_tokens"] == (0 if j == 0 else len(prefix))
        # the hit-rate plot: the burst's prefills hit 5 x 300 of 6 x 303 prompt tokens (82 %)
        page.wait_for_function("document.getElementById('plot-hitrate').dataset.max >= 50", timeout=POLL_TIMEOUT_MS)
        hit_after = plot(page, "hitrate")
        assert hit_after["points"] > (hit_before["points"] or 0)
        # the KV gauge: the tree now caches the prefix and the six branches after it
        page.wait_for_function(f"+document.querySelector('.replica .kv-gauge').dataset.evictable >= "
                               f"{gauge_before['evictable'] + len(prefix) + 6 * 3}", timeout=POLL_TIMEOUT_MS)
        assert gauge(page)["free"] < gauge_before["free"]
        assert page.get_attribute(".replica .kv-gauge .seg-evictable", "style") != ""
        # the longest shared prefix: 300 tokens, shared by the six sequences (the tree's walk is
        # refreshed every few seconds)
        page.wait_for_function("""() => [...document.querySelectorAll('.replica .prefixes tbody tr')].some(
            r => r.cells.length === 4 && r.cells[0].textContent === '300' && r.cells[1].textContent === '6'
                 && r.cells[2].textContent === 'no')""", timeout=POLL_TIMEOUT_MS)
        assert page.problems == []
    finally:
        page.context.close()


def test_data_endpoint_needs_the_admin_key(browser, dash_server):
    url = dash_server.url
    assert httpx.get(url + "/dashboard/state").status_code == 401
    assert httpx.get(url + "/dashboard/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.get(url + "/dashboard/state", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert ok.status_code == 200 and ok.json()["replicas"][0]["dashboard"]["kv"]["total"] > 0
    # the page and its files hold no data: they load without a key, and the page then asks for it
    page_resp = httpx.get(url + "/dashboard")
    assert page_resp.status_code == 200 and "text/html" in page_resp.headers["content-type"]
    assert httpx.get(url + "/dashboard/assets/dashboard.js").status_code == 200
    assert httpx.get(url + "/dashboard/assets/nope.js").status_code == 404
    page = open_page(browser, dash_server, admin_key="")
    try:
        page.wait_for_selector("#error:not([hidden])", timeout=POLL_TIMEOUT_MS)
        assert "admin key" in page.text_content("#error") and page.get_attribute("#keys", "open") is not None
        assert page.text_content("#c-running") == "–"  # no data shown
        page.fill("#admin-key", ADMIN_KEY)
        page.dispatch_event("#admin-key", "change")
        page.wait_for_function("document.getElementById('status').textContent === 'up'", timeout=POLL_TIMEOUT_MS)
        assert page.is_hidden("#error")
    finally:
        page.context.close()
