"""The pages' screenshots in docs/images/: a ``duetime serve`` over its embedded pool, some
traffic for the dashboard's charts, the playground's request, the demo's run; each page at
1280x800 and 390 px wide, in Debian's headless chromium (through Playwright).

    python scripts/screenshots.py [--seconds 40] [--out docs/images]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from playwright.sync_api import Page, sync_playwright

ROOT = Path(__file__).resolve().parents[1]


def serve() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "duetime", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit("duetime serve did not start")


def traffic(url: str, stop: threading.Event) -> None:
    """Poisson chat requests, the rate wandering between 4 and 16 a second."""
    rng = random.Random(0)
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=200)) as c:
        def one(words: int) -> None:
            # (requests still open when the server stops fail: no matter)
            with contextlib.suppress(httpx.HTTPError):
                c.post(url + "/v1/chat/completions", json={
                    "model": "auto", "max_tokens": rng.choice((16, 64, 128)),
                    "messages": [{"role": "user", "content": "tell me more " * words}]})
        t0 = time.monotonic()
        while not stop.is_set():
            rate = 16.0 if (time.monotonic() - t0) % 20 < 10 else 4.0
            threading.Thread(target=one, args=(rng.choice((50, 400, 1500)),), daemon=True).start()
            time.sleep(rng.expovariate(rate))


def both(page: Page, name: str, out: Path) -> None:
    page.set_viewport_size({"width": 1280, "height": 800})
    page.wait_for_timeout(400)
    page.screenshot(path=str(out / f"{name}.png"), full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(400)
    page.screenshot(path=str(out / f"{name}-390.png"), full_page=False)
    page.set_viewport_size({"width": 1280, "height": 800})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40.0, help="traffic before the shots")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    proc, url = serve()
    stop = threading.Event()
    try:
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=shutil.which("chromium"),
                                  args=["--no-sandbox", "--disable-gpu"])
            page = b.new_page(viewport={"width": 1280, "height": 800})
            page.goto(url + "/dashboard")
            threading.Thread(target=traffic, args=(url, stop), daemon=True).start()
            page.wait_for_timeout(args.seconds * 1000)
            both(page, "dashboard", args.out)
            stop.set()
            page.goto(url + "/playground")
            page.wait_for_function("document.body.dataset.ready === '1'")
            page.fill("#target", "500")
            page.click("#send")
            page.wait_for_function("document.body.dataset.answered === '1'", timeout=60_000)
            both(page, "playground", args.out)
            page.goto(url + "/demo")
            page.wait_for_selector("#routers tbody tr", timeout=60_000)
            page.wait_for_timeout(1500)
            both(page, "demo", args.out)
            b.close()
    finally:
        stop.set()
        proc.terminate()
        proc.wait(30)
    print(f"screenshots in {args.out}:", *sorted(q.name for q in args.out.glob("*.png")))


if __name__ == "__main__":
    main()
