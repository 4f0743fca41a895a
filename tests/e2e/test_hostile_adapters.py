"""Issue 22, on the CPU demo server in a subprocess: adapter files that are hostile or change on disk never
crash, stall or escape the server, and slow connections are closed. One adapter slot and one host-cache
entry (--max-loras 1 --max-cpu-loras 1), so that serving another adapter evicts one completely and its
next request re-reads it from disk. Each case is listed in docs/RELIABILITY.md with its test."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tools.loadgen import DEMO, make_adapters
from tools.serverlib import ServerProcess

PROMPT = "words: cat ant moon fox =>"
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 1.0, 2.0
TYPE_NAMES = ("RecursionError", "OverflowError", "ValueError", "Exception", "Error:")


class Srv:
    def __init__(self, proc: ServerProcess, work: Path) -> None:
        self.proc, self.root, self.outside = proc, work / "adapters", work / "outside"
        self.http = httpx.Client(base_url=proc.url, headers=proc.headers, timeout=60)

    def load(self, name: str, path: str) -> httpx.Response:
        return self.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    def unload(self, name: str) -> httpx.Response:
        return self.http.post("/v1/unload_lora_adapter", json={"lora_name": name})

    def complete(self, model: str, client: httpx.Client | None = None, max_tokens: int = 8) -> httpx.Response:
        return (client or self.http).post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                                                   "max_tokens": max_tokens, "temperature": 0})

    def copy(self, src: str, name: str) -> Path:
        dst = self.root / name
        shutil.copytree(src, dst)
        return dst

    def still_fine(self) -> None:
        assert self.proc.proc.poll() is None, self.proc.log_tail()
        assert self.http.get("/health").status_code == 200
        r = self.complete("a01")
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" CAT"), r.text


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[Srv]:
    work = tmp_path_factory.mktemp("hostile")
    (work / "outside").mkdir()
    paths = make_adapters(work / "adapters", 3, strength=0.0)  # a00 reverse, a01 upper, a02 sort (exact copies)
    flags = ["--max-loras", "1", "--max-cpu-loras", "1", "--lora-root", str(work / "adapters"),
             "--lora-modules", *(f"{n}={p}" for n, p in paths.items())]
    env = {"XPULORA_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S), "XPULORA_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)}
    proc = ServerProcess(str(DEMO / "model"), flags, work / "server.log", env)
    try:
        proc.wait_ready()
        yield Srv(proc, work)
    finally:
        proc.stop()


def _assert_adapter_error(r: httpx.Response, status: int, name: str, text: str) -> None:
    msg = r.json()["error"]["message"]
    assert r.status_code == status and f"adapter {name!r}" in msg and text in msg, r.text
    assert not any(t in msg for t in TYPE_NAMES), msg


# -- crash: an evicted adapter whose config is rewritten ------------------------------------------------------------
def test_rewritten_config_of_an_evicted_adapter_is_a_400_not_a_dead_server(srv: Srv) -> None:
    d = srv.copy(str(srv.root / "a00"), "ev")
    good = (d / "adapter_config.json").read_bytes()
    assert srv.load("ev", str(d)).status_code == 200
    assert srv.complete("ev").json()["choices"][0]["text"].startswith(" fox moon")
    rewrites = {"nested": b"[" * 100_000 + b"]" * 100_000,
                "bigint": good.replace(b'"lora_alpha": 16', b'"lora_alpha": ' + b"7" * 400),
                "valid-but-other": good.replace(b'"lora_alpha": 16', b'"lora_alpha": 17')}
    for what, raw in rewrites.items():
        assert raw != good
        srv.still_fine()  # serves a01: evicts ev from the slot and from the host cache
        (d / "adapter_config.json").write_bytes(raw)
        r = srv.complete("ev")
        _assert_adapter_error(r, 400, "ev", "changed on disk")
        assert "unload and load it again" in r.json()["error"]["message"], what
        srv.still_fine()
    # the same bytes as loaded: the re-read is consistent again
    (d / "adapter_config.json").write_bytes(good)
    srv.still_fine()
    assert srv.complete("ev").json()["choices"][0]["text"].startswith(" fox moon")
    assert srv.unload("ev").status_code == 200


# -- stall: regexes that backtrack forever in Python's re -------------------------------------------------------------
def test_hostile_regex_load_stalls_neither_health_nor_other_requests(srv: Srv) -> None:
    d = srv.copy(str(srv.root / "a00"), "rx")
    cfg = json.loads((d / "adapter_config.json").read_text())
    # Python's re: ~3 s per module name (the whole load ~25 s, holding the interpreter lock); RE2: linear
    cfg.update(target_modules=r".{6}(.*)*X|.*(q|v)_proj", rank_pattern={"(.*.*)*X": 4}, exclude_modules="(.*.*)*Y")
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    result: list[httpx.Response] = []
    loader = threading.Thread(target=lambda: result.append(srv.load("rx", str(d))))
    t0 = time.monotonic()
    loader.start()
    lat = []
    with httpx.Client(base_url=srv.proc.url, headers=srv.proc.headers, timeout=30) as other:
        for _ in range(3):
            t = time.monotonic()
            assert other.get("/health").status_code == 200
            assert srv.complete("a01", other).status_code == 200
            lat.append(time.monotonic() - t)
    loader.join(60)
    assert max(lat) < 1.0, lat
    assert result and result[0].status_code == 200, result and result[0].text
    assert time.monotonic() - t0 < 10
    assert srv.complete("rx").json()["choices"][0]["text"].startswith(" fox moon")
    assert srv.unload("rx").status_code == 200
    # 20,000 pattern keys: refused by count before any is compiled
    cfg.update(rank_pattern={f"layers\\.{i}\\.q_proj": 8 for i in range(20_000)})
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    _assert_adapter_error(srv.load("rx", str(d)), 400, "rx", "at most 1024")
    srv.still_fine()


# -- 500s: malformed configs and weights headers ------------------------------------------------------------------
def _malformed(srv: Srv) -> dict[str, tuple[Path, str]]:
    src = srv.root / "a00"
    good = json.loads((src / "adapter_config.json").read_text())
    raw_good = json.dumps(good)
    cases = {
        "deep": ("[" * 100_000 + "]" * 100_000, "nests more than"),
        "deepfield": (raw_good[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}", "nests more than"),
        "alpha400": (raw_good.replace('"lora_alpha": 16', '"lora_alpha": ' + "9" * 400), "a number of 400"),
        "r5000": (raw_good.replace('"r": 8', '"r": ' + "9" * 5000), "a number of 5000"),
        "alpha-inf": (raw_good.replace('"lora_alpha": 16', '"lora_alpha": 1e999'), "lora_alpha must be a finite"),
        "rankpat-big": (json.dumps({**good, "rank_pattern": {"q_proj": 10**15}}), "rank_pattern['q_proj']"),
        "layers-big": (json.dumps({**good, "layers_to_transform": [10**15]}), "layers_to_transform"),
        "groups": (json.dumps({**good, "target_modules": "(" * 5000 + "q_proj" + ")" * 5000}), "characters"),
        "lookahead": (json.dumps({**good, "target_modules": "(?=q).*_proj"}), "not a valid regex"),
    }
    out = {}
    for name, (text, expect) in cases.items():
        d = srv.root / f"m-{name}"
        d.mkdir()
        (d / "adapter_config.json").write_text(text)
        shutil.copy(src / "adapter_model.safetensors", d / "adapter_model.safetensors")
        out[f"m-{name}"] = (d, expect)
    d = srv.copy(str(src), "m-deepheader")  # the weights' JSON header nested 100,000 deep
    header = b"[" * 50_000 + b"]" * 50_000
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    out["m-deepheader"] = (d, "nests more than")
    return out


def test_malformed_configs_are_the_adapters_400_at_load_and_autoload(srv: Srv) -> None:
    for name, (d, expect) in _malformed(srv).items():
        _assert_adapter_error(srv.load(name, str(d)), 400, name, expect)
        r = srv.complete(name)  # autoload on first use
        assert r.status_code == 400 and name in r.json()["error"]["message"] and expect in r.text, (name, r.text)
    assert "Traceback" not in srv.proc.log_tail(10**7)
    srv.still_fine()


# -- escape: a folder swapped with a symlink to outside the root while loads run ----------------------------------------
@pytest.mark.slow
def test_symlink_swap_race_never_loads_from_outside_and_never_5xx(srv: Srv) -> None:
    shutil.copytree(srv.root / "a01", srv.outside / "evil")  # outside: the 'upper' adapter
    srv.copy(str(srv.root / "a00"), "x")  # inside: the 'reverse' adapter
    x, park = srv.root / "x", srv.root / ".x-parked"
    stop = threading.Event()

    def swapper() -> None:
        while not stop.is_set():
            os.rename(x, park)
            os.symlink(srv.outside / "evil", x)
            time.sleep(0.0005)
            os.unlink(x)
            os.rename(park, x)
            time.sleep(0.0005)

    t = threading.Thread(target=swapper)
    t.start()
    statuses: dict[int, int] = {}
    outside = loaded = 0
    deadline = time.monotonic() + 6
    try:
        i = 0
        while time.monotonic() < deadline:
            i += 1
            r = srv.load(f"x{i}", "x")
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code != 200:
                continue
            loaded += 1
            root = next(m["root"] for m in srv.http.get("/v1/models").json()["data"] if m["id"] == f"x{i}")
            text = srv.complete(f"x{i}", max_tokens=4).json()["choices"][0]["text"]
            outside += (not root.startswith(str(srv.root.resolve()))) + text.startswith(" CAT")
            assert srv.unload(f"x{i}").status_code == 200
    finally:
        stop.set()
        t.join()
    assert not any(s >= 500 for s in statuses), statuses
    assert outside == 0 and loaded > 0 and statuses.get(403, 0) > 0, (statuses, outside)
    srv.still_fine()


# -- connections: unfinished headers / bodies ---------------------------------------------------------------------------
def _closed_after(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closes the connection (reading what it sends), at most `limit`."""
    t0, got = time.monotonic(), b""
    sock.settimeout(limit)
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        return float("inf"), got
    return time.monotonic() - t0, got


def test_slow_header_and_slow_body_connections_are_closed(srv: Srv) -> None:
    host, port = "127.0.0.1", srv.proc.port
    slow = [socket.create_connection((host, port)) for _ in range(50)]
    for s in slow:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    srv.still_fine()  # while they hang, others are served
    took, got = _closed_after(slow[0], HEADER_TIMEOUT_S + 5)
    assert took < HEADER_TIMEOUT_S + 1.5 and got.startswith(b"HTTP/1.1 408"), (took, got)
    for s in slow[1:]:
        assert _closed_after(s, 2)[0] < 2
        s.close()
    body = socket.create_connection((host, port))
    body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    took, _ = _closed_after(body, BODY_TIMEOUT_S + 5)
    assert took < BODY_TIMEOUT_S + 1.5, took
    body.close()
    srv.still_fine()
