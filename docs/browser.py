"""Headless Chromium for the tests of the HTML we ship (the attention viewer, the docs page).

Standard library only: Chromium's DevTools protocol over `--remote-debugging-pipe`.
The flags keep it off the network: no background connections, and every host name
resolves to nothing (`--host-resolver-rules`), so a page that tries to fetch
anything shows a failed request in the log instead of reaching out.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

CHROMIUM = shutil.which("chromium")
NO_CHROMIUM = "no `chromium` on PATH (Debian's package; .ci/run installs it)"


class Chromium:
    """Headless Chromium driven through the DevTools protocol over a pipe (stdlib only).

    `--remote-debugging-pipe` makes Chromium read JSON commands from fd 3 and
    write replies and events to fd 4, each message ending in a NUL byte.
    """

    FLAGS = (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--disable-dev-shm-usage",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--remote-debugging-pipe",
    )

    STARTS = 3  # tries: a browser that dies while starting on a loaded machine is started again

    events: list[dict]  # the protocol's events, in order of arrival
    _to_child: int = -1  # our ends of the pipes (-1: closed, or never opened)
    _from_child: int = -1

    def __init__(self, binary: str, profile: Path, log: Path | None = None):
        self.log = log or Path(profile).parent / f"{Path(profile).name}.chromium.log"
        failures = []
        for attempt in range(self.STARTS):
            try:
                self._start(binary, Path(f"{profile}-{attempt}") if attempt else Path(profile))
                return
            except (EOFError, TimeoutError, BrokenPipeError) as e:  # died or hung while starting
                failures.append(f"try {attempt + 1}: {e}")
                self._stop()
        raise RuntimeError(f"Chromium did not start in {self.STARTS} tries: {'; '.join(failures)}")

    def _start(self, binary: str, profile: Path) -> None:
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def wire_fds():  # in the child: our pipe ends become its fds 3 and 4
            a, b = os.dup(to_child_r), os.dup(from_child_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [binary, *self.FLAGS, f"--user-data-dir={profile}", "about:blank"],
                preexec_fn=wire_fds,
                close_fds=False,
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
            )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf, self._id, self.events = b"", 0, []
        target = self.send("Target.createTarget", url="about:blank", timeout=120)["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def _stop(self) -> None:
        """End a browser that failed to start, and close our ends of its pipes."""
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._to_child = self._from_child = -1

    def _died(self) -> str:
        """Why the pipe closed: the browser's exit status and the end of its log."""
        code = self.proc.poll() if getattr(self, "proc", None) is not None else None
        tail = self.log.read_bytes()[-600:].decode(errors="replace") if self.log.exists() else ""
        return f"exit status {code}; log {self.log}: ...{tail}"

    def _next_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._from_child], [], [], max(0.0, deadline - time.time()))
            if not ready:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise EOFError(f"Chromium closed the DevTools pipe ({self._died()})")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        message = json.loads(raw)
        if "method" in message:
            self.events.append(message)
        return message

    def send(self, method: str, session: bool = False, timeout: float = 120, **params) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            reply = self._next_message(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def page(self, method: str, **params) -> dict:
        return self.send(method, session=True, **params)

    def open(
        self, url: str, width: int = 1200, height: int = 900, domains: tuple[str, ...] = ("Network", "Page")
    ) -> None:
        """Watch `domains` (Network: every request is recorded), size the window, load `url` and wait for it."""
        for domain in domains:
            self.page(f"{domain}.enable")
        self.page("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.page("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired")

    def wait_event(self, method: str, timeout: float = 120) -> dict:
        deadline = time.time() + timeout
        seen = [e for e in self.events if e["method"] == method]
        if seen:
            self.events.remove(seen[0])
            return seen[0]
        while True:
            message = self._next_message(deadline)
            if message.get("method") == method:
                self.events.remove(message)
                return message

    def js(self, expression: str):
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_js(self, expression: str, timeout: float = 60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.js(expression):
                return
            time.sleep(0.05)
        raise TimeoutError(f"never true: {expression}")

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e["method"] == "Network.requestWillBeSent"]

    def close(self):
        try:
            self.send("Browser.close", timeout=10)
        except Exception:  # noqa: BLE001 the browser may already be gone; closing goes on either way
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stop()
