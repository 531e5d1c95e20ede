"""A `python app.py` process driven from outside, as a user runs it: started on a free loopback port, its
/health, its engine workers, and the memory and open files of each of its processes (read from /proc, so
Linux only). The soak bench and the end-to-end API tests (tests/test_openai_api.py) share it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def process_tree(root: int) -> list[int]:
    """`root` and its live descendants, `root` first (Linux: /proc)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


class AppNotReady(RuntimeError):
    """app.py exited, or did not answer /health with 200, in time; the message ends with its log's tail."""


class ServedApp:
    """`python app.py --port P *flags` with its output in `log`; nothing leaves 127.0.0.1."""

    def __init__(self, *flags: str, log: Path, env: dict[str, str] | None = None):
        from engine.parallel.groups import free_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "STUDIO_API_KEY": "", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "app.py", "--host", "127.0.0.1", "--port", str(self.port),
                                      *flags], cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> float:
        """Seconds until /health answers 200; AppNotReady if the process exits or `timeout` passes first."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AppNotReady(f"app.py exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AppNotReady(f"app.py did not become ready in {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")

    def health(self, timeout: float = 5) -> dict:
        return httpx.get(self.url + "/health", timeout=timeout).json()

    def wait_idle(self, timeout: float) -> float:
        """Seconds until the engine runs nothing and nothing waits (AssertionError after `timeout`)."""
        t0 = time.monotonic()
        while True:
            h = self.health()
            if h["state"] == "ready" and not h["running"] and h["queue"] == 0:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"engine not idle after {timeout} s: {h}")
            time.sleep(0.02)

    def _tree(self) -> list[int]:
        """The server process and its descendants (the engine workers)."""
        return process_tree(self.proc.pid)

    def worker_pids(self) -> list[int]:
        """The engine workers: the server's spawned children (not multiprocessing's resource tracker)."""
        out = []
        for pid in self._tree()[1:]:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                out.append(pid)
        return out

    def rss_by_process(self) -> dict[str, int]:
        """Resident memory of each: 'server', 'worker <pid>', 'other <pid>' (multiprocessing's helpers)."""
        out, workers = {}, self.worker_pids()
        for pid in self._tree():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
            except (OSError, StopIteration):
                continue
            name = "server" if pid == self.proc.pid else ("worker" if pid in workers else "other")
            out[name if name == "server" else f"{name} {pid}"] = rss
        return out

    def rss_bytes(self) -> int:
        """Resident memory of the server process and its engine workers."""
        return sum(self.rss_by_process().values())

    def open_files(self) -> int:
        """File descriptors the server process holds (sockets, pipes to the engine, uploads)."""
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def threads(self) -> int:
        """Threads of the server process (its event loop, the pumps to the engine, the routes' pool)."""
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def children(self) -> int:
        """Processes below the server: its engine workers and multiprocessing's helpers."""
        return len(self._tree()) - 1

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
