"""A real browser for the pages' tests: Debian's ``chromium``, headless, driven by Playwright
pointed at that executable (Playwright's own browser download is not used;
``scripts/system_deps.sh`` installs ``chromium``). A missing browser fails the tests: a skip is
not a pass.

``page``: a fresh 1280x800 page whose JavaScript errors (uncaught exceptions and
``console.error``) fail the test at teardown; ``shot(page, name)`` writes a screenshot to
``$DUETIME_ARTIFACTS`` (default ``tests/artifacts/``, ignored by git) as a test artefact.
``served``: a ``duetime serve`` process over its embedded demo pool, on a free loopback port.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("DUETIME_ARTIFACTS", ROOT / "tests" / "artifacts"))


def chromium_path() -> str:
    """The system's chromium (``$DUETIME_CHROMIUM`` first)."""
    path = os.environ.get("DUETIME_CHROMIUM") or next(
        (p for p in (shutil.which(n) for n in ("chromium", "chromium-browser")) if p), None)
    if path is None:
        pytest.fail("no chromium on PATH: run scripts/system_deps.sh (Debian's chromium) or "
                    "set DUETIME_CHROMIUM")
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Per module: Playwright's sync API runs an event loop in the test thread while it is
    open, so that the other tests' ``asyncio.run`` would fail after it in the same session."""
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


class CheckedPage:
    """A page and the JavaScript errors it raised."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.errors: list[str] = []
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        page.on("console", lambda m: self.errors.append(f"console.error: {m.text}")
                if m.type == "error" else None)


@pytest.fixture
def checked(browser: Browser) -> Iterator[CheckedPage]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    cp = CheckedPage(ctx.new_page())
    try:
        yield cp
    finally:
        ctx.close()
    assert not cp.errors, "JavaScript errors on the page:\n" + "\n".join(cp.errors)


@pytest.fixture
def page(checked: CheckedPage) -> Page:
    return checked.page


def shot(page: Page, name: str) -> Path:
    """A full-page screenshot, ``<name>.png`` under the artefacts folder."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


class Served:
    """A running ``duetime serve`` (its URL)."""

    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc = proc
        self.url = url


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """``duetime serve --port 0`` over its embedded pool; its banner gives the URL."""
    proc = subprocess.Popen([sys.executable, "-m", "duetime", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    url = None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"gateway listening on (http://\S+)", line)
        if m:
            url = m.group(1)
    if url is None:
        proc.kill()
        pytest.fail("duetime serve did not start:\n" + "".join(lines))
    # (drain its output, or a full pipe would block it)
    import threading
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    try:
        httpx.get(url + "/health", timeout=10).raise_for_status()
        yield Served(proc, url)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
