"""/demo in a real browser: the simulation runs and is drawn (uPlot canvases, the four routers'
table with numbers), a batch knob changes the predicted step time, and the page is readable at
390 px wide (screenshots ``demo`` and ``demo-390``). No sleeps: every wait is on the DOM."""

from __future__ import annotations

import re

from playwright.sync_api import Page

from browser.conftest import Served, shot

WAIT_MS = 120_000  # generous: the first simulation may load compiled kernels


def wait_for_simulation(page: Page) -> None:
    page.wait_for_function(
        "document.querySelectorAll('#routers tbody tr').length === 4 && !document.getElementById('run').disabled",
        timeout=WAIT_MS)
    for chart in ("queue-chart", "ttft-chart", "decode-chart", "sweep-chart"):
        page.wait_for_selector(f"#{chart} canvas", state="attached", timeout=WAIT_MS)


def set_range(page: Page, knob: str, value: int) -> None:
    page.eval_on_selector(f"#{knob}", "(e, v) => { e.value = v; e.dispatchEvent(new Event('input')); }",
                          value)


def test_demo_page(served: Served, page: Page) -> None:
    page.goto(served.url + "/demo")
    wait_for_simulation(page)
    rows = page.locator("#routers tbody tr")
    names = [rows.nth(i).locator("td").first.inner_text() for i in range(4)]
    assert names == ["latency-agnostic", "round-robin", "shortest-queue", "sfs"]
    for i in range(4):
        cells = rows.nth(i).locator("td").all_inner_texts()[1:]
        assert len(cells) == 5 and all(re.search(r"\d", c) for c in cells), cells
    assert page.locator("tr.chosen td").first.inner_text() == "sfs"

    # another router and rate: the table stays four routers, the chosen row follows
    page.select_option("#router", "round-robin")
    page.wait_for_function(
        "document.querySelector('tr.chosen td') && document.querySelector('tr.chosen td').textContent === 'round-robin'",
        timeout=WAIT_MS)

    # the batch panel: a longer decode context makes the same tokens slower
    total = page.locator('.bt-total[data-instance="qwen3-8b"]')
    total.wait_for(timeout=WAIT_MS)
    page.wait_for_selector("#bsweep-chart canvas", state="attached", timeout=WAIT_MS)
    before = total.inner_text()
    set_range(page, "decode_context", 30000)
    page.wait_for_function(
        "(b) => document.querySelector('.bt-total[data-instance=\"qwen3-8b\"]').textContent !== b",
        arg=before, timeout=WAIT_MS)
    assert total.inner_text() != before
    page.select_option("#vary", "decode_share")
    page.wait_for_function("document.getElementById('bsweep-title').textContent.includes('decode sequences')",
                           timeout=WAIT_MS)
    wait_for_simulation(page)
    shot(page, "demo")

    page.set_viewport_size({"width": 390, "height": 844})
    page.reload()
    wait_for_simulation(page)
    page.locator(".bt-total").first.wait_for(timeout=WAIT_MS)
    # nothing wider than the screen but the table, which scrolls in its own box
    overflow = page.evaluate("document.documentElement.scrollWidth")
    assert overflow <= 390, overflow
    shot(page, "demo-390")
