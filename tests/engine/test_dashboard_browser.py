"""The dashboard in a real browser (headless Chromium driven by Playwright) against a live
server on the real vLLM CPU engine, with API keys: the queue, the KV chart and the
finished-agents plot change as agents run; a tenant's page shows only its agents; no console
errors. Screenshots are saved under each test's tmp_path.

Debian's chromium is used (Playwright's own browser download is not reachable from these
machines); .ci/run installs it, so a missing browser is a failure, not a skip.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.servers import embedded_server
from tests.support.waiting import wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEYS = {"alice": "browser-alice-0123456789", "bob": "browser-bob-9876543210",
        "admin": "browser-admin-5555555555"}
PROMPT = "Summarize the findings of the committee on fair scheduling. " * 6


@pytest.fixture(scope="module")
def dash_server(justitia_home: str) -> Iterator:
    # The one extra engine server of this module: the engine tier's KV settings, with keys.
    with embedded_server(["--kv-tokens", "4096", "--max-model-len", "2048"], KEYS, justitia_home) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (`apt-get install -y chromium`; "
                    ".ci/run does it) to run the dashboard's browser tests")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """One browser tab on the dashboard, signed in with a tenant's key; it collects every
    console error and uncaught exception."""

    def __init__(self, browser, url: str, tenant: str, shots: Path) -> None:
        self.context = browser.new_context(viewport={"width": 1400, "height": 1100})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.shots = shots
        self.tenant = tenant
        self.page.goto(url + "/dashboard")
        # With keys configured, the page asks for one before it calls anything.
        self.page.wait_for_selector("#auth:not([hidden])")
        self.page.fill("#key", KEYS[tenant])
        self.page.click("#auth button[type=submit]")
        self.page.wait_for_selector("#main:not([hidden])")
        wait_until(lambda: self.attr("#kv-chart", "data-samples"), 10)

    def ids(self) -> list[str]:
        return self.page.eval_on_selector_all("#queue tbody tr", "rows => rows.map(r => r.dataset.id)")

    def attr(self, selector: str, name: str) -> str | None:
        return self.page.get_attribute(selector, name)

    def number(self, selector: str, name: str) -> float:
        return float(self.attr(selector, name) or 0)

    def shot(self, name: str) -> Path:
        path = self.shots / f"{self.tenant}-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def close(self) -> None:
        self.context.close()


def run_agents(url: str, tenant: str, n: int, out: list[str], errors: list[BaseException],
               go: threading.Event | None = None) -> None:
    """`n` agents of two stages of three requests each, registered at once, then run (once
    `go` is set, if given: registered agents are listed until they end)."""
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=300) as c:
            ids = [c.post("/v1/agents", json={"type": f"{tenant}_summary", "prompt": PROMPT}).json()["id"]
                   for _ in range(n)]
            out.extend(ids)
            if go is not None and not go.wait(120):
                raise TimeoutError("the test never let the agents run")
            threads = [threading.Thread(target=run_one, args=(c, i, errors)) for i in ids]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    except BaseException as exc:  # seen by the test, not lost with the thread
        errors.append(exc)


def run_one(c: httpx.Client, agent_id: str, errors: list[BaseException]) -> None:
    try:
        for _stage in range(2):
            calls = [threading.Thread(target=lambda: c.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 120, "ignore_eos": True, "agent_id": agent_id,
            }).raise_for_status()) for _ in range(3)]
            for t in calls:
                t.start()
            for t in calls:
                t.join()
        c.post(f"/v1/agents/{agent_id}/finish").raise_for_status()
    except BaseException as exc:
        errors.append(exc)


def start(url: str, tenant: str, n: int, ids: list[str], errors: list[BaseException],
          go: threading.Event | None = None) -> threading.Thread:
    t = threading.Thread(target=run_agents, args=(url, tenant, n, ids, errors, go), daemon=True)
    t.start()
    return t


def test_the_dashboard_follows_agents_as_they_run(dash_server, browser, tmp_path: Path) -> None:
    admin = Page(browser, dash_server.url, "admin", tmp_path)
    try:
        assert admin.page.is_visible("th.tenant-col"), "the admin sees the tenant column"
        finished_before = admin.number("#finished-plot", "data-points")
        admin.shot("0-idle")
        ids: dict[str, list[str]] = {"alice": [], "bob": []}
        errors: list[BaseException] = []
        runs = [start(dash_server.url, t, 6, ids[t], errors) for t in ("alice", "bob")]
        everyone = lambda: set(ids["alice"]) | set(ids["bob"])  # noqa: E731
        # The queue fills with the agents of both tenants, in the policy's order.
        seen = wait_until(lambda: set(admin.ids()) & everyone(), 60, 0.2)
        assert seen
        wait_until(lambda: admin.page.locator("#queue tbody tr.running").count() > 0, 60, 0.2,
                   show=lambda: admin.ids())
        tenants = set(admin.page.eval_on_selector_all("#queue tbody td.tenant", "tds => tds.map(t => t.textContent)"))
        assert tenants <= {"alice", "bob"} and tenants
        positions = admin.page.eval_on_selector_all("#queue tbody td.pos", "tds => tds.map(t => +t.textContent)")
        assert positions == sorted(positions)
        # The KV chart shows memory reserved and used by the running agents.
        wait_until(lambda: admin.number("#kv-chart", "data-reserved-max") > 0, 60, 0.2)
        wait_until(lambda: admin.number("#kv-chart", "data-used-max") > 0, 60, 0.2)
        admin.shot("1-running")
        for t in runs:
            t.join(300)
        assert not errors, errors
        # Every agent finished: the queue empties and the finished-agents plot has them all.
        wait_until(lambda: not set(admin.ids()) & everyone(), 30, 0.2, show=admin.ids)
        wait_until(lambda: admin.number("#finished-plot", "data-points") >= finished_before + 12, 30, 0.2)
        # the histogram and the plot's marks follow in the same render, or the next
        wait_until(lambda: int(admin.attr("#jct-hist", "data-count") or 0) >= 12
                   and admin.page.locator("#finished-plot circle.eta").count() >= 12
                   and admin.page.locator("#finished-plot rect.dl").count() >= 12, 30, 0.2)
        # one KV sample a second: a run shorter than five seconds has fewer yet
        wait_until(lambda: int(admin.attr("#kv-chart", "data-samples") or 0) >= 5, 30, 0.2)
        assert "justitia" in admin.page.text_content("#info")
        shot = admin.shot("2-finished")
        assert shot.stat().st_size > 10_000
        assert admin.errors == [], admin.errors
    finally:
        admin.close()


def test_a_tenant_sees_only_its_own_agents(dash_server, browser, tmp_path: Path) -> None:
    alice = Page(browser, dash_server.url, "alice", tmp_path)
    bob = Page(browser, dash_server.url, "bob", tmp_path)
    try:
        assert not alice.page.is_visible("th.tenant-col"), "a tenant sees no tenant column"
        assert "tenant alice" in alice.page.text_content("#who")
        ids: dict[str, list[str]] = {"alice": [], "bob": []}
        errors: list[BaseException] = []
        go = threading.Event()
        runs = [start(dash_server.url, t, 4, ids[t], errors, go) for t in ("alice", "bob")]
        finished_alice = alice.number("#finished-plot", "data-points")
        alice_seen: set[str] = set()
        bob_seen: set[str] = set()

        def look() -> bool:
            alice_seen.update(alice.ids())
            bob_seen.update(bob.ids())
            return bool(alice_seen & set(ids["alice"]) and bob_seen & set(ids["bob"]))

        # The agents wait, registered, until each page has listed some of its own (a run of
        # four short agents can end between two of the page's frames), then run.
        try:
            wait_until(look, 60, 0.1, show=lambda: (alice_seen, bob_seen, ids))
        finally:
            go.set()
        while any(t.is_alive() for t in runs):  # what each page showed while the agents ran
            look()
            alice.page.wait_for_timeout(100)
        for t in runs:
            t.join(300)
        assert not errors, errors
        assert alice_seen & set(ids["alice"]) and bob_seen & set(ids["bob"]), (alice_seen, bob_seen, ids)
        assert not alice_seen & set(ids["bob"]), "alice's page showed bob's agents"
        assert not bob_seen & set(ids["alice"]), "bob's page showed alice's agents"
        # Finished agents: alice's plot gets her 4, not bob's.
        wait_until(lambda: alice.number("#finished-plot", "data-points") >= finished_alice + 4, 30, 0.2)
        titles = alice.page.eval_on_selector_all("#finished-plot title", "ts => ts.map(t => t.textContent)")
        assert not any(i in t for t in titles for i in ids["bob"])
        alice.shot("tenant")
        bob.shot("tenant")
        assert alice.errors == [] and bob.errors == [], (alice.errors, bob.errors)
    finally:
        alice.close()
        bob.close()


def test_the_page_asks_for_a_key_and_keeps_it_out_of_urls(dash_server, browser, tmp_path: Path) -> None:
    alice = Page(browser, dash_server.url, "alice", tmp_path)
    try:
        urls: list[str] = []
        alice.page.on("request", lambda r: urls.append(r.url))
        alice.page.reload()  # the key stays in this tab's sessionStorage: no prompt
        alice.page.wait_for_selector("#main:not([hidden])")
        assert alice.page.evaluate("sessionStorage.getItem('justitia.key')") == KEYS["alice"]
        assert urls and not any(KEYS["alice"] in u for u in urls)
        alice.page.click("#forget")
        alice.page.wait_for_selector("#auth:not([hidden])")
        assert alice.page.evaluate("sessionStorage.getItem('justitia.key')") is None
        assert alice.errors == [], alice.errors
    finally:
        alice.close()
