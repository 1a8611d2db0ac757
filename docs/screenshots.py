"""Remake the dashboard screenshots in docs/ from a fresh `jobtrail demo` ledger.

    python docs/screenshots.py          # needs jobtrail[dashboard,webhooks], playwright and /usr/bin/chromium

Runs the demo (real operations against the bundled fake provider: retries, reconciliation,
webhooks, results, two that need a person), starts the dashboard with an access token,
signs in in headless Chromium and saves the list, the busiest operation's timeline, the
needs-a-person queue, and the list on a phone-sized screen.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

from jobtrail import Store

DOCS = Path(__file__).parent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "demo.db")
        subprocess.run([sys.executable, "-m", "jobtrail", "--db", db, "demo"], check=True, cwd=tmp, capture_output=True)
        with Store.open(db) as store:
            busiest = max(
                (op for op in store.list_operations(limit=None) if op.state.value == "succeeded"),
                key=lambda op: len(store.history(op.operation_id)) + len(store.observations(op.operation_id)),
            )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        token = secrets.token_hex(16)
        env = {**os.environ, "DASHBOARD_TOKEN": token}
        server = subprocess.Popen(
            [sys.executable, "-m", "jobtrail", "--db", db, "dashboard", "--port", str(port), "--token-env",
             "DASHBOARD_TOKEN"],
            env=env,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            time.sleep(2)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium")
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                page.goto(base + "/login")
                page.fill("input[name=token]", token)
                page.click("button:has-text('Sign in')")
                page.wait_for_url(base + "/")
                page.screenshot(path=DOCS / "dashboard-list.png", full_page=True)
                page.goto(f"{base}/ops/{busiest.operation_id}")
                page.screenshot(path=DOCS / "dashboard-operation.png", full_page=True)
                page.goto(base + "/queue")
                page.screenshot(path=DOCS / "dashboard-queue.png", full_page=True)
                page.set_viewport_size({"width": 390, "height": 844})
                page.goto(base + "/")
                page.screenshot(path=DOCS / "dashboard-phone.png")
                browser.close()
        finally:
            server.terminate()
            server.wait(10)
    print("wrote", ", ".join(sorted(p.name for p in DOCS.glob("dashboard-*.png"))))


if __name__ == "__main__":
    main()
