"""The dashboard and the playground in a real browser (headless chromium) against a real
``duetime serve``: every instance is drawn, the numbers move when traffic flows, the
playground's request shows its answer and its explanation; no JavaScript error anywhere
(:mod:`tests.browser.conftest`); screenshots at 1280x800 and 390 px wide as artefacts."""

from __future__ import annotations

import threading

import httpx
from playwright.sync_api import Page, expect

from browser.conftest import CheckedPage, Served, shot

WAIT_MS = 60_000  # (conditions are waited for, never slept on: any machine's speed)


def instances(served: Served) -> list[str]:
    return [i["name"] for i in httpx.get(served.url + "/duetime/instances").json()["instances"]]


class Traffic:
    """Chat requests, four at a time, in the background until stopped (``sent``: how many
    were answered)."""

    def __init__(self, served: Served) -> None:
        self.url = served.url + "/v1/chat/completions"
        self.stop = threading.Event()
        self.sent = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(4)]
        for t in self.threads:
            t.start()

    def run(self) -> None:
        body = {"model": "auto", "max_tokens": 8,
                "messages": [{"role": "user", "content": "Tell me about batching. " * 20}]}
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                if c.post(self.url, json=body).status_code == 200:
                    with self.lock:
                        self.sent += 1

    def join(self) -> int:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        return self.sent


def fits(page: Page, width: int) -> bool:
    """Nothing wider than the viewport (wide tables scroll inside their own box)."""
    return page.evaluate("document.documentElement.scrollWidth") <= width + 1


def test_the_dashboard_draws_every_instance_and_moves_with_traffic(served: Served,
                                                                   page: Page) -> None:
    names = instances(served)
    page.goto(served.url + "/dashboard")
    for n in names:
        expect(page.locator(f'.card[data-instance="{n}"]')).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#status")).to_have_text("live", timeout=WAIT_MS)
    assert page.locator(".uplot canvas").count() >= 3  # the three charts are drawn
    first = page.evaluate("Number(document.body.dataset.updates)")

    def served_total() -> int:
        return sum(int(page.locator(f'.card[data-instance="{n}"] dd[data-k="first tokens '
                                    f'(1 min)"]').inner_text()) for n in names)

    assert served_total() == 0
    traffic = Traffic(served)
    try:
        # the numbers move: decisions listed, explained as they come (one each 2 s)
        page.wait_for_function(f"Number(document.body.dataset.updates) > {first + 1}",
                               timeout=WAIT_MS)
        expect(page.locator("#decisions tbody tr").first).to_be_visible(timeout=WAIT_MS)
        expect(page.locator("#explanation table tr.chosen")).to_have_count(1, timeout=WAIT_MS)
        # a listed decision's explanation on demand (then pinned: updates leave it)
        link = page.locator("#decisions a", has_text="explain").first
        expect(link).to_be_visible(timeout=WAIT_MS)
        link.click()
        expect(page.locator("#explanation")).to_contain_text("Request dt-")
        page.wait_for_function("document.querySelectorAll('#decisions tbody tr').length "
                               "=== 20", timeout=WAIT_MS)  # (the latest 20)
    finally:
        sent = traffic.join()
    page.wait_for_function(  # (every one counted, once the next update comes)
        "[...document.querySelectorAll('dd[data-k=\"first tokens (1 min)\"]')]"
        f".reduce((s, e) => s + Number(e.textContent), 0) === {sent}", timeout=WAIT_MS)
    chosen = page.locator("#explanation tr.chosen").get_attribute("data-instance")
    assert chosen in names
    expect(page.locator("#explanation table")).to_be_visible()
    shot(page, "dashboard")
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(300)  # (a resize: let the charts follow)
    assert fits(page, 390)
    shot(page, "dashboard-390")


def test_the_playground_answers_and_explains(served: Served, checked: CheckedPage) -> None:
    page = checked.page
    names = instances(served)
    page.goto(served.url + "/playground")
    page.wait_for_function("document.body.dataset.ready === '1'", timeout=WAIT_MS)
    assert page.locator("#policy option").count() > 10  # every registered policy
    page.select_option("#policy", "sfs")
    page.fill("#target", "5000")
    page.fill("#prompt", "What is time to first token?")
    page.click("#send")
    page.wait_for_function("document.body.dataset.answered === '1'", timeout=WAIT_MS)
    assert page.locator("#error").inner_text() == ""
    assert len(page.locator("#answer").inner_text()) > 0
    inst = page.locator("#f-instance b").inner_text()
    assert inst in names
    assert page.locator("#f-observed b").inner_text().endswith("s")  # "12 ms" / "1.2 s"
    assert page.locator("#f-forecast b").inner_text().endswith("s")
    assert page.locator("#why tr.chosen").get_attribute("data-instance") == inst
    assert page.locator("#why tbody tr").count() == len(names)
    shot(page, "playground")
    # a dry run sends nothing and explains
    page.select_option("#policy", "shortest-queue")
    page.click("#dry")
    page.wait_for_function("document.body.dataset.dryRuns === '1'", timeout=WAIT_MS)
    expect(page.locator("#why")).to_contain_text("nothing was sent")
    expect(page.locator("#why")).to_contain_text("shortest-queue")
    # a bad value: the gateway's error, shown; nothing else breaks
    page.fill("#target", "0")
    page.click("#dry")
    expect(page.locator("#error")).to_contain_text("x-duetime-ttft-ms", timeout=WAIT_MS)
    # (chromium logs the 400 it was answered as a console error: that one is expected)
    checked.errors = [e for e in checked.errors if "status of 400" not in e]
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(300)
    assert fits(page, 390)
    shot(page, "playground-390")
