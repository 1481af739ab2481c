"""End-to-end: the dashboard in headless Chromium (Debian's package, driven through
Selenium with Debian's chromedriver, nothing downloaded) against an admin server on
loopback with simulated destinations. Saves ``artifacts/dashboard*.png``."""

from __future__ import annotations

import asyncio
import copy
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from admin_helpers import TOKEN
from aiohttp import ClientSession

from federation_sender.admin.app import build_admin_app, dashboard_page
from federation_sender.admin.server import start_http_server
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.admin_fakes import FakeQueueControl, seed_destinations
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.prereq import missing, require_module

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
SEEDED = 60


async def test_dashboard_is_served_with_a_strict_csp(tmp_path: Path) -> None:
    body, csp = dashboard_page()
    assert b"<script>" in body
    assert "default-src 'none'" in csp and "'unsafe-inline'" not in csp
    assert "connect-src 'self'" in csp and "sha256-" in csp
    # No external resources: every URL-ish attribute is relative.
    text = body.decode()
    assert "http://" not in text and "https://" not in text and "//" not in text.split(
        "<script>")[0].replace("<!--", "")
    eng = create_engine(f"sqlite:///{tmp_path}/d.db")
    try:
        app = build_admin_app(storage=NativeBackend(eng), token=TOKEN, queues=FakeQueueControl(),
                              clock=FakeClock())
        server = await start_http_server(app, "127.0.0.1", 0)
        try:
            async with ClientSession() as s, s.get(server.url + "/dashboard") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Security-Policy"] == csp
                assert resp.headers["Cache-Control"] == "no-store"
        finally:
            await server.stop()
    finally:
        await eng.dispose()


def _ensure_chromium() -> None:
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.path.exists(path):
            missing(f"{path} (Debian package {package})")


@dataclass
class Served:
    url: str
    queues: FakeQueueControl
    names: list[str]
    counters: dict[str, float]
    _stop: Any = field(repr=False, default=None)
    _run: Any = field(repr=False, default=None)
    """Runs a coroutine function on the server's loop and waits for it."""
    _pause: Any = field(repr=False, default=None)
    _resume: Any = field(repr=False, default=None)

    def pause(self) -> None:
        """Stop answering (the listener closes), as a crashed worker would."""
        self._run(self._pause)

    def resume(self) -> None:
        """Answer again on the same port."""
        self._run(self._resume)


@pytest.fixture
def served(served_module: Served) -> Iterator[Served]:
    """The module's admin app, its fake queues' live states and counters as they were
    seeded at each test's start: the tests run in a random order, and each sets states
    of its own."""
    states = copy.deepcopy(served_module.queues.states)
    counters = dict(served_module.counters)
    yield served_module
    served_module.queues.states.clear()
    served_module.queues.states.update(states)
    served_module.counters.clear()
    served_module.counters.update(counters)


@pytest.fixture(scope="module")
def served_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The admin app on its own loop in a thread: Selenium's calls block."""
    db = tmp_path_factory.mktemp("dash") / "admin.db"
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        engine = create_engine(f"sqlite:///{db}")
        await upgrade(engine)
        clock = FakeClock()
        queues = FakeQueueControl(engine)
        names = await seed_destinations(engine, clock, SEEDED, queues=queues)
        counters: dict[str, float] = {"transactions_sent": 0.0, "transactions_failed": 0.0,
                                      "pdus_delivered": 0.0, "replication_lag": 0.0}

        def app() -> Any:
            return build_admin_app(storage=NativeBackend(engine), token=TOKEN, queues=queues,
                                   clock=clock, counters=lambda: counters)

        servers = [await start_http_server(app(), "127.0.0.1", 0)]
        port = int(servers[0].url.rsplit(":", 1)[1])
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def pause() -> None:
            await servers.pop().stop()

        async def resume() -> None:
            servers.append(await start_http_server(app(), "127.0.0.1", port))

        def run(fn: Any) -> None:
            asyncio.run_coroutine_threadsafe(fn(), loop).result(10)

        box["served"] = Served(servers[0].url, queues, names, counters,
                               lambda: loop.call_soon_threadsafe(stop.set), run, pause, resume)
        ready.set()
        await stop.wait()
        for server in servers:
            await server.stop()
        await engine.dispose()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert ready.wait(30), "admin server did not start"
    yield box["served"]
    box["served"]._stop()
    thread.join(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    webdriver: Any = require_module("selenium.webdriver", "pip install -e '.[dev]'")
    from selenium.webdriver.chrome.service import Service

    _ensure_chromium()
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    yield driver
    driver.quit()


def _wait(driver: Any, predicate: Any, timeout: float = 10.0) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # Live refresh re-renders the table, so elements found a moment ago may be gone.
    return WebDriverWait(driver, timeout, poll_frequency=0.05,
                         ignored_exceptions=[StaleElementReferenceException]).until(predicate)


def _rows(driver: Any) -> list[str]:
    return list(driver.execute_script(
        "return [...document.querySelectorAll('#dest-table tbody tr[data-destination]')]"
        ".map(r => r.dataset.destination)"))


def _row_text(driver: Any, name: str) -> str:
    return str(driver.execute_script(
        "const r = [...document.querySelectorAll('#dest-table tbody tr')]"
        ".find(r => r.dataset.destination === arguments[0]); return r ? r.innerText : '';",
        name))


def test_dashboard_end_to_end(served: Served, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    ARTIFACTS.mkdir(exist_ok=True)
    d = browser
    # Signed out, whichever of this module's tests ran before in this tab (random order).
    d.get(served.url + "/dashboard")
    d.execute_script("sessionStorage.clear()")
    d.get_log("browser")  # read is emptied: what earlier tests caused (the banner's refusals)
    d.get(served.url + "/dashboard")

    # A wrong token is refused and the form comes back with the reason.
    _wait(d, lambda d: d.find_element(By.ID, "login").is_displayed())
    d.find_element(By.ID, "token-input").send_keys("wrong")
    d.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
    _wait(d, lambda d: "refused" in d.find_element(By.ID, "login-error").text)

    d.find_element(By.ID, "token-input").send_keys(TOKEN)
    d.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()

    # The list renders: first page of 50, sorted, with live states and pagination.
    _wait(d, lambda d: len(_rows(d)) == 50)
    assert _rows(d) == sorted(served.names)[:50]
    assert f"of {SEEDED}" in d.find_element(By.ID, "page-info").text
    assert "Destinations: 60" in d.find_element(By.ID, "stats").text
    busy = next(n for n in served.names if n.startswith("busy"))
    assert "sending" in _row_text(d, busy)
    d.find_element(By.ID, "next").click()
    _wait(d, lambda d: len(_rows(d)) == SEEDED - 50)
    d.find_element(By.ID, "prev").click()
    _wait(d, lambda d: len(_rows(d)) == 50)

    # The token never appears in the URL; it lives in sessionStorage only.
    assert TOKEN not in d.current_url
    assert d.execute_script(
        "return sessionStorage.getItem('federation_sender_admin_token')") == TOKEN

    # Sorting by a column header flips the order.
    d.find_element(By.CSS_SELECTOR, 'th[data-sort="destination"] button').click()
    _wait(d, lambda d: _rows(d)[:1] == [sorted(served.names)[-1]])

    # Search filters (server-side, case-insensitive substring).
    d.find_element(By.ID, "search").send_keys("FAILING")
    failing = sorted((n for n in served.names if n.startswith("failing")), reverse=True)
    _wait(d, lambda d: _rows(d) == failing)
    d.save_screenshot(str(ARTIFACTS / "dashboard-search.png"))

    # Detail view with rooms and transactions; reset with confirmation.
    target = failing[0]
    d.find_element(By.CSS_SELECTOR, f'button[data-destination="{target}"]').click()
    _wait(d, lambda d: d.find_element(By.ID, "detail").is_displayed()
          and d.find_element(By.ID, "detail-title").text == target)
    _wait(d, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#room-table tbody tr")) == 3)
    _wait(d, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#txn-table tbody tr")) == 3)
    assert "connection refused" in d.find_element(By.ID, "txn-table").text
    assert "backing off" in d.find_element(By.ID, "detail-fields").text
    reset = d.find_element(By.ID, "reset-btn")
    assert reset.is_enabled()
    reset.click()
    _wait(d, lambda d: d.find_element(By.ID, "confirm").is_displayed())
    d.find_element(By.ID, "confirm-cancel").click()
    assert served.queues.resets == []
    reset.click()
    _wait(d, lambda d: d.find_element(By.ID, "confirm").is_displayed())
    d.save_screenshot(str(ARTIFACTS / "dashboard-confirm.png"))
    d.find_element(By.ID, "confirm-ok").click()
    # The status line may already show the next live refresh, so wait on the effect.
    _wait(d, lambda d: served.queues.resets == [target])
    _wait(d, lambda d: not d.find_element(By.ID, "reset-btn").is_enabled())
    _wait(d, lambda d: "backing off" not in _row_text(d, target))
    d.save_screenshot(str(ARTIFACTS / "dashboard.png"))

    # No CSP violations or script errors on the way.
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"
              and "401" not in e["message"]]
    assert errors == []


def test_live_refresh_picks_up_changes(served: Served, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    d = browser
    _sign_in(d, served)
    name = sorted(served.names)[0]
    served.queues.set_state(name, "sending", pending_pdus=4242, pending_edus=7)
    _wait(d, lambda d: "4242" in _row_text(d, name), timeout=12)
    # Forgetting the token returns to the form and clears storage.
    d.find_element(By.ID, "signout").click()
    _wait(d, lambda d: d.find_element(By.ID, "login").is_displayed())
    assert d.execute_script(
        "return sessionStorage.getItem('federation_sender_admin_token')") is None


DOCS_IMAGES = (Path(__file__).resolve().parents[2] / "docs" / "images"
               if os.environ.get("FEDERATION_SENDER_DOC_IMAGES") else ARTIFACTS)
"""Screenshots go to artifacts/; with FEDERATION_SENDER_DOC_IMAGES=1 they replace the
ones docs/admin-api.md shows."""


def _summary(served: Served) -> dict[str, Any]:
    import json
    import urllib.request

    req = urllib.request.Request(served.url + "/_synapse/admin/v1/federation/summary",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        body: dict[str, Any] = json.loads(resp.read())
    return body


def _sign_in(d: Any, served: Served) -> None:
    from selenium.webdriver.common.by import By

    d.get(served.url + "/dashboard")
    if d.execute_script("return sessionStorage.getItem('federation_sender_admin_token')") is None:
        _wait(d, lambda d: d.find_element(By.ID, "login").is_displayed())
        d.find_element(By.ID, "token-input").send_keys(TOKEN)
        d.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
    _wait(d, lambda d: len(_rows(d)) > 0)


def _poke(d: Any) -> None:
    """Make the page refresh now instead of in up to 5 s (the sort direction flips)."""
    d.execute_script("const s = document.getElementById('dir');"
                     "s.value = s.value === 'f' ? 'b' : 'f';"
                     "s.dispatchEvent(new Event('change'));")


def _chart(d: Any, chart: str) -> tuple[int, float | None]:
    points, last = d.execute_script(
        "const f = document.getElementById('chart-' + arguments[0]);"
        "return [Number(f.dataset.points), f.dataset.last];", chart)
    return int(points), (float(last) if last else None)


def test_counts_agree_with_the_api_and_charts_draw_the_counters(
        served: Served, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    d = browser
    d.set_window_size(1400, 1000)
    _sign_in(d, served)
    # Catch-up is a mode that outlives a backoff: a queue backing off in catch-up mode
    # counts as catching up, in the API and the metric alike.
    a, b = sorted(served.names)[:2]
    served.queues.set_state(a, "backing_off", catching_up=True, last_error="HTTP 503")
    served.queues.set_state(b, "catching_up")
    expected = sum(1 for s in served.queues.states.values() if s["catching_up"])
    assert _summary(served)["catching_up_destinations"] == expected
    _poke(d)
    _wait(d, lambda d: f"Catching up: {expected}" in d.find_element(By.ID, "stats").text)
    # Every refresh adds a sample; rates come from consecutive samples.
    for step in range(1, 4):
        served.counters["transactions_sent"] += 10
        served.counters["pdus_delivered"] += 200
        served.counters["transactions_failed"] += step
        served.counters["replication_lag"] = 7.0
        before = _chart(d, "tx")[0]
        _poke(d)
        _wait(d, lambda d, before=before: _chart(d, "tx")[0] > before)
    points, last = _chart(d, "tx")
    assert points >= 3 and last is not None and last > 0
    assert (_chart(d, "pdus")[1] or 0) > (_chart(d, "tx")[1] or 0)
    assert _chart(d, "lag")[1] == 7.0
    assert "max" in d.find_element(By.ID, "chart-failures").text
    DOCS_IMAGES.mkdir(exist_ok=True)
    d.save_screenshot(str(DOCS_IMAGES / "dashboard-wide.png"))


def test_usable_at_phone_width(served: Served, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    d = browser
    d.set_window_size(390, 844)
    try:
        _sign_in(d, served)
        assert d.execute_script("return window.innerWidth") <= 390
        overflow = ("return document.documentElement.scrollWidth - "
                    "document.documentElement.clientWidth")
        assert d.execute_script(overflow) <= 0
        # Rows become cards whose cells are labelled (the header row is hidden).
        failing = next(n for n in sorted(served.names) if n.startswith("failing"))
        assert d.execute_script(
            "const td = document.querySelector('#dest-table tbody td[data-label]');"
            "return [getComputedStyle(td).display, getComputedStyle(td, '::before').content,"
            " getComputedStyle(document.querySelector('#dest-table thead')).display]"
        ) == ["flex", '"State"', "none"]
        assert "connection refused" in _row_text(d, failing)
        d.execute_script("document.getElementById('charts').scrollIntoView()")
        d.save_screenshot(str(DOCS_IMAGES / "dashboard-phone.png"))
        d.find_element(By.CSS_SELECTOR, f'button[data-destination="{failing}"]').click()
        _wait(d, lambda d: d.find_element(By.ID, "detail").is_displayed())
        _wait(d, lambda d: "stream position" in d.find_element(By.ID, "detail-fields").text
              or "Last success" in d.find_element(By.ID, "detail-fields").text)
        assert d.execute_script(overflow) <= 0
    finally:
        d.set_window_size(1400, 1000)


def test_a_banner_says_when_the_worker_stops_answering(served: Served, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    d = browser
    _sign_in(d, served)
    banner = d.find_element(By.ID, "banner")
    assert not banner.is_displayed()
    served.pause()
    try:
        _poke(d)
        _wait(d, lambda d: d.find_element(By.ID, "banner").is_displayed())
        assert "not answering" in d.find_element(By.ID, "banner").text
        # The last figures stay on screen under the banner.
        assert len(_rows(d)) > 0
        d.save_screenshot(str(DOCS_IMAGES / "dashboard-banner.png"))
    finally:
        served.resume()
    _poke(d)
    _wait(d, lambda d: not d.find_element(By.ID, "banner").is_displayed())
