"""A headless Chromium driven over the DevTools protocol, for tests of what a browser shows (no Selenium, no npm).

``Browser.find()`` is None when no Chromium is installed (Debian: ``apt-get install chromium``); tests skip then.
The browser starts with a fresh profile and without background networking (the test machine has no internet).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


class Browser:
    """One headless Chromium process with one page, controlled through its DevTools websocket."""

    def __init__(self, binary: str, width: int = 1400, height: int = 2000):
        self._profile = tempfile.TemporaryDirectory(prefix="gtpo-chromium-")
        self._proc = subprocess.Popen(
            [
                binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--remote-debugging-port=0", f"--user-data-dir={self._profile.name}",
                f"--window-size={width},{height}", "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._ws = None
        self._next_id = 0
        try:
            port = self._wait_for_port(Path(self._profile.name) / "DevToolsActivePort")
            targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
            page = next(t for t in targets if t.get("type") == "page")
            from websockets.sync.client import connect

            self._connection = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
            self._ws = self._connection.__enter__()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def find() -> str | None:
        return next((path for name in CANDIDATES if (path := shutil.which(name))), None)

    def _wait_for_port(self, port_file: Path, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if port_file.is_file() and port_file.read_text().strip():
                return int(port_file.read_text().split()[0])
            if self._proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self._proc.returncode} before opening its DevTools port")
            time.sleep(0.1)
        raise TimeoutError(f"chromium opened no DevTools port within {timeout} s")

    def send(self, method: str, **params) -> dict:
        """One DevTools command; returns its result (events that arrive meanwhile are dropped)."""
        self._next_id += 1
        self._ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv(timeout=60))
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def open(self, path: Path) -> None:
        """Load a local file and wait until the document is complete."""
        self.send("Page.enable")
        self.send("Page.navigate", url=path.resolve().as_uri())
        deadline = time.monotonic() + 60
        while self.evaluate("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not finish loading")
            time.sleep(0.05)

    def evaluate(self, expression: str):
        """The JSON value of a JavaScript expression in the page."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def hover(self, x: float, y: float) -> None:
        """Move the mouse pointer to page coordinates (x, y), as a user hovering there."""
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def screenshot(self) -> bytes:
        """PNG of the whole page."""
        metrics = self.send("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": metrics["width"], "height": metrics["height"], "scale": 1}
        data = self.send("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)["data"]
        return base64.b64decode(data)

    def close(self) -> None:
        if self._ws is not None:
            self._connection.__exit__(None, None, None)
            self._ws = None
        self._proc.terminate()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._profile.cleanup()
