"""Open an HTML page in headless Chromium, check that its charts rendered, take a screenshot.

Drives Debian's `chromium` over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
NUL-terminated JSON on file descriptors 3 and 4), so it needs no websocket client and no
browser download. It records what a person would see go wrong: console errors, uncaught
exceptions, and any request that leaves the page's own file (a self-contained report makes
none). Used by the report tests and to make the docs' screenshot:

    python -m tests.chromium runs/<name>/report.html docs/report.png --height 1800

Cancellation/timeouts: every wait has a deadline (TimeoutError naming what it waited for);
the browser process is killed and its profile directory removed on every exit path.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PageCheck", "check_page", "chromium_path"]

_CHARTS_JS = """JSON.stringify({
  expected: Number((document.querySelector('meta[name="flotilla-charts"]') || {}).content || -1),
  height: document.documentElement.scrollHeight,
  charts: Array.from(document.querySelectorAll('.plotly-graph-div')).map(d => {
    const r = d.getBoundingClientRect();
    return {id: d.id, width: r.width, height: r.height,
            rendered: d.classList.contains('js-plotly-plot') && !!d.querySelector('svg.main-svg'),
            traces: (d.data || []).length};
  })})"""


def chromium_path() -> str | None:
    # Debian's /usr/bin/chromium is a shell wrapper whose sourced settings files reuse
    # descriptors 3 and 4; the binary behind it keeps the debugging pipe intact.
    for binary in ("/usr/lib/chromium/chromium",):
        if os.access(binary, os.X_OK):
            return binary
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class PageCheck:
    """What the browser saw."""

    expected_charts: int
    charts: list[dict[str, Any]]
    console_errors: list[str] = field(default_factory=list)
    external_requests: list[str] = field(default_factory=list)
    page_height: int = 0
    screenshot: Path | None = None

    @property
    def problems(self) -> list[str]:
        out = [f"console: {e}" for e in self.console_errors]
        out += [f"network request: {u}" for u in self.external_requests]
        if self.expected_charts != len(self.charts):
            out.append(f"page declares {self.expected_charts} charts, found {len(self.charts)}")
        for c in self.charts:
            if not c["rendered"] or c["width"] <= 0 or c["height"] <= 0 or c["traces"] == 0:
                out.append(f"chart {c['id']} did not render: {c}")
        return out


class _Pipe:
    """The DevTools protocol over Chromium's debugging pipe."""

    def __init__(self, proc: subprocess.Popen, send_fd: int, recv_fd: int) -> None:
        self.proc = proc
        self.send_fd, self.recv_fd = send_fd, recv_fd
        self.buf = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []
        self.sel = selectors.DefaultSelector()
        self.sel.register(recv_fd, selectors.EVENT_READ)

    def _read_message(self, deadline: float, what: str) -> dict[str, Any]:
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"chromium: no answer while waiting for {what}")
            if not self.sel.select(timeout=left):
                continue
            chunk = os.read(self.recv_fd, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed its pipe while waiting for {what} (exit code {self.proc.poll()})")
            self.buf += chunk
        raw, _, self.buf = self.buf.partition(b"\0")
        return json.loads(raw)

    def call(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None, timeout: float = 30.0
    ) -> dict[str, Any]:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.send_fd, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline, method)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"chromium: {method} failed: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float) -> dict[str, Any]:
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            e = self._read_message(deadline, method)
            if e.get("method") == method:
                return e
            self.events.append(e)


def _collect(events: list[dict[str, Any]], page_url: str) -> tuple[list[str], list[str]]:
    errors, requests = [], []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
        elif m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            errors.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            errors.append(p["entry"].get("text", ""))
        elif m == "Network.requestWillBeSent":
            url = p.get("request", {}).get("url", "")
            if url != page_url and not url.startswith(("data:", "blob:", "about:")):
                requests.append(url)
    return errors, requests


def _above_9(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


def check_page(
    html_path: str | Path,
    screenshot: str | Path | None = None,
    *,
    width: int = 1280,
    height: int = 900,
    shot_height: int | None = None,
    timeout: float = 60.0,
) -> PageCheck:
    """Load `html_path` in headless Chromium and report what rendered (see `PageCheck`).

    `screenshot`: write a PNG of the page's top `shot_height` CSS pixels (default: the whole
    page). Raises FileNotFoundError when no chromium is installed, TimeoutError when the page
    or its charts do not finish within `timeout` seconds.
    """
    exe = chromium_path()
    if exe is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    url = Path(html_path).resolve().as_uri()
    profile = tempfile.mkdtemp(prefix="flotilla-chromium-")
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()
    # The child's ends move above 9 first, so that giving them the numbers 3 and 4 can never
    # close one of them (a pipe end may itself be descriptor 3 or 4 here).
    to_chrome_r, from_chrome_w = _above_9(to_chrome_r), _above_9(from_chrome_w)
    # bash (dash takes one-digit descriptors only) moves the pipe ends to the descriptor numbers Chromium expects (3: commands in,
    # 4: replies out) before it becomes the browser.
    cmd = [
        "bash",
        "-c",
        f'exec "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-',
        "bash",
        exe,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--remote-debugging-pipe",
        f"--user-data-dir={profile}",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-sync",
        "--disable-component-update",
        "--hide-scrollbars",
        "about:blank",
    ]
    proc = subprocess.Popen(
        cmd,
        pass_fds=(to_chrome_r, from_chrome_w),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(to_chrome_r)
    os.close(from_chrome_w)
    try:
        cdp = _Pipe(proc, to_chrome_w, from_chrome_r)
        target = cdp.call("Target.createTarget", {"url": "about:blank"}, timeout=timeout)["targetId"]
        session = cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            cdp.call(f"{domain}.enable", session=session)
        cdp.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        cdp.call("Page.navigate", {"url": url}, session=session, timeout=timeout)
        cdp.wait_event("Page.loadEventFired", timeout)
        deadline = time.monotonic() + timeout
        while True:
            res = cdp.call("Runtime.evaluate", {"expression": _CHARTS_JS, "returnByValue": True}, session=session)
            info = json.loads(res["result"]["value"])
            if all(c["rendered"] for c in info["charts"]) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        errors, requests = _collect(cdp.events, url)
        check = PageCheck(
            expected_charts=info["expected"],
            charts=info["charts"],
            console_errors=errors,
            external_requests=requests,
            page_height=info["height"],
        )
        if screenshot is not None:
            h = min(shot_height or info["height"], info["height"])
            shot = cdp.call(
                "Page.captureScreenshot",
                {
                    "format": "png",
                    "captureBeyondViewport": True,
                    "clip": {"x": 0, "y": 0, "width": width, "height": h, "scale": 1},
                },
                session=session,
                timeout=timeout,
            )
            path = Path(screenshot)
            path.write_bytes(base64.b64decode(shot["data"]))
            check.screenshot = path
        with contextlib.suppress(RuntimeError, TimeoutError):  # it is killed below either way
            cdp.call("Browser.close", timeout=5)
        return check
    finally:
        os.close(to_chrome_w)
        os.close(from_chrome_r)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("html")
    ap.add_argument("png")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=None, help="CSS pixels of the page to capture")
    args = ap.parse_args(argv)
    check = check_page(args.html, args.png, width=args.width, shot_height=args.height)
    for p in check.problems:
        print(f"problem: {p}", file=sys.stderr)
    print(
        json.dumps(
            {
                "charts": len(check.charts),
                "rendered": sum(c["rendered"] for c in check.charts),
                "console_errors": len(check.console_errors),
                "png": str(check.screenshot),
                "png_bytes": check.screenshot.stat().st_size if check.screenshot else 0,
            }
        )
    )
    return 1 if check.problems else 0


if __name__ == "__main__":
    sys.exit(main())
