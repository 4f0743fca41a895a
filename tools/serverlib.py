"""A real `python -m server` in a subprocess, for end-to-end tests with the openai client and httpx."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
API_KEY = "test-key"
_SAMPLE = re.compile(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$")
_MODEL_LABEL = re.compile(r'model_name="[^"]*",?|,model_name="[^"]*"')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str | None, flags: list[str], log_path: Path, env: dict[str, str] | None = None,
                 program: list[str] | None = None) -> None:
        """model None: the flags name the model themselves (anywhere among them). program: another
        OpenAI-compatible server's command in place of `python -m server` (e.g. a peer's `vllm serve`); it
        runs in its own session and stop() ends its whole process group, children included."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._group = program is not None
        cmd = [*(program or [sys.executable, "-m", "server"]), *([model] if model else []), "--port", str(self.port),
               "--api-key", API_KEY, *flags]
        self._log = open(log_path, "w")  # noqa: SIM115 - lives as long as the process
        # The repository first, then the caller's import path (a device run's carried wheels live there).
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false",
                                          **(env or {})}, start_new_session=self._group)
        self.headers = {"Authorization": f"Bearer {API_KEY}"}

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def _signal(self, sig: int) -> None:
        if self._group:
            with contextlib.suppress(ProcessLookupError):  # the group is gone already
                os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(10)
        if self._group:  # children that outlived their parent (e.g. an engine process)
            self._signal(signal.SIGKILL)
        self._log.close()
        return self.proc.returncode

    def metrics(self, keep_model_name: bool = False) -> dict[str, float]:
        """name{labels} -> value for every sample in /metrics; the model_name label (on every series, one
        value per server) is left out of the keys unless keep_model_name."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m and not line.startswith("#"):
                labels = m.group(2) or ""
                if not keep_model_name:
                    labels = _MODEL_LABEL.sub("", labels).replace("{}", "")
                out[m.group(1) + labels] = float(m.group(3))
        return out

    def wait_metrics(self, ok: Callable[[dict[str, float]], bool], timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until ok(metrics) or the timeout; returns the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if ok(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Wait until nothing runs or waits and every KV block is free."""
        return self.wait_metrics(lambda m: m["xpulora:kv_cache_usage_perc"] == 0.0 and m[
            "xpulora:num_requests_running"] == 0 and m["xpulora:num_requests_waiting"] == 0, timeout)
