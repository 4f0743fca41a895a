"""Docker HEALTHCHECK of the xpulora image: GET /health where a client outside the container would connect.

The port is the running server's own: from its command line (`xpulora serve ...`, found under /proc, also
when an init process such as `docker run --init` is PID 1), `--port` or the `--config` preset's `port`.
The address is the container's non-loopback one, so a server that listens on the loopback only
(`--host 127.0.0.1`) is unhealthy: nothing outside the container could reach it. XPULORA_HEALTH_URL, when
set, is used as it is.
Exit status 0: healthy; 1: not (the message lands in `docker inspect`'s health log).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml


def _serve_args(argv: list[str]) -> list[str] | None:
    """`serve ...` if ARGV runs the server: `xpulora serve`, `python -m server.cli_main serve` or
    `python -m server` (which is `xpulora serve`)."""
    for i, arg in enumerate(argv):
        rest = argv[i + 1:]
        if (Path(arg).name == "xpulora" or arg == "server.cli_main") and rest[:1] == ["serve"]:
            return rest
        if arg == "server" and argv[i - 1:i] == ["-m"]:
            return ["serve", *rest]
    return None


def serve_commands() -> Iterator[tuple[int, list[str]]]:
    """(pid, its `serve ...` arguments) of every process running the server, by pid."""
    for proc in sorted(Path("/proc").glob("[0-9]*"), key=lambda p: int(p.name)):
        try:
            argv = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0")[:-1]]
        except OSError:
            continue
        args = _serve_args(argv)
        if args is not None:
            yield int(proc.name), args


def external_address() -> str:
    """The address of the interface that holds the default route (no packet is sent: UDP connect only picks
    the route); without a route, what the container's hostname resolves to (`hostname -i`)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere, any default route matches
        return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        s.close()


def server_port(args: list[str]) -> int:
    """The port `xpulora serve` takes from ARGS (`serve ...`): --port, else the --config preset's `port`, else
    8000. Read here rather than through server.cli, which imports torch: seconds per check on a busy host."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--port", type=int)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(args[1:])
    if known.port is not None:
        return known.port
    if known.config:
        with open(known.config) as f:
            preset = yaml.safe_load(f) or {}
        if "port" in preset:
            return int(preset["port"])
    return 8000


def health_url(args: list[str]) -> str:
    """Where a client outside the container reaches /health of the server started with ARGS (`serve ...`)."""
    return f"http://{external_address()}:{server_port(args)}/health"


def probe(url: str) -> str:
    """GET URL; raises unless it answers 200 within 8 s."""
    with urllib.request.urlopen(url, timeout=8) as r:
        return f"{url}: {r.status}"


def main() -> int:
    try:
        url = os.environ.get("XPULORA_HEALTH_URL")
        if not url:
            # The container's server: the lowest pid (PID 1, or the child of an init such as `docker run --init`).
            first = next(serve_commands(), None)
            if first is None:
                raise RuntimeError("no `xpulora serve` process runs in this container")
            url = health_url(first[1])
        print(probe(url))
        return 0
    except (Exception, SystemExit) as e:  # any failure (argparse exits) is "unhealthy", its reason logged
        print(f"unhealthy: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
