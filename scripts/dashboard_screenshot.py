"""Take the README's screenshot of /dashboard (issue 59) with the headless browser the tests use.

    radixserve serve --model-path MODEL.gguf &            # any running server
    python scripts/dashboard_screenshot.py --url http://127.0.0.1:30000 --out docs/dashboard.png

It sends some traffic first (requests that share a long prefix, then a chat message typed into
the page's playground), waits for the plots to fill, and saves a full-page PNG reduced to a
256-colour palette (a small file to commit). Needs Chromium (apt-get install chromium) and
Playwright (the test extra).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import threading
import time

import httpx


def traffic(url: str, headers: dict, rounds: int, model: str) -> None:
    """Bursts of streamed chat requests sharing a long system prompt: prefix hits, batches, a full
    tree, and TTFT / ITL (which the page takes from streamed requests)."""
    system = "You are a helpful assistant who answers questions about lighthouses in detail. " * 8
    questions = ["Why are lighthouses tall?", "Who kept lighthouses?", "How far does the light reach?",
                 "What is a Fresnel lens?", "Why do lighthouses have stripes?", "Name a famous lighthouse."]

    def ask(http: httpx.Client, question: str) -> None:
        body = {"model": model, "max_tokens": 48, "temperature": 0.7, "stream": True,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for _ in r.iter_lines():
                pass

    with httpx.Client(base_url=url, headers=headers, timeout=300) as http:
        for _ in range(rounds):
            threads = [threading.Thread(target=ask, args=(http, q)) for q in questions]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            time.sleep(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--api-key", default="")
    p.add_argument("--admin-key", default="")
    p.add_argument("--out", default="docs/dashboard.png")
    p.add_argument("--rounds", type=int, default=6, help="bursts of shared-prefix requests before the shot")
    p.add_argument("--chat", default="In two sentences, what does a lighthouse keeper do?")
    p.add_argument("--width", type=int, default=1400)
    args = p.parse_args()

    from PIL import Image
    from playwright.sync_api import sync_playwright

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx.get(args.url + "/v1/models", headers=headers).json()["data"][0]["id"]
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        ctx = browser.new_context(viewport={"width": args.width, "height": 1000})
        ctx.add_init_script(f"sessionStorage.setItem('radixserve.apiKey', {json.dumps(args.api_key)});"
                            f"sessionStorage.setItem('radixserve.adminKey', {json.dumps(args.admin_key)})")
        page = ctx.new_page()
        page.goto(args.url + "/dashboard")
        traffic(args.url, headers, args.rounds, model)
        page.fill("#chat-temperature", "0")
        page.fill("#chat-input", args.chat)
        page.press("#chat-input", "Enter")
        page.wait_for_selector(".msg.assistant[data-state=done]", timeout=300_000)
        page.wait_for_timeout(2500)
        png = page.screenshot(full_page=True)
        browser.close()
    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    image.save(args.out, optimize=True)
    print(f"wrote {args.out} ({image.size[0]}x{image.size[1]})")


if __name__ == "__main__":
    main()
