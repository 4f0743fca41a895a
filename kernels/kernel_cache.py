"""The folder where kernels keep what they measured or compiled on this machine, and the lock that lets one
process do that work while the others wait and read its result.

    folder = cache_dir()                        # $XPULORA_KERNEL_CACHE_DIR, else $XDG_CACHE_HOME/xpulora, else
                                                # ~/.cache/xpulora; None for XPULORA_KERNEL_CACHE_DIR=off
    with cache_lock(".name.lock"): ...          # exclusive between processes (and open files) of this machine

Users: kernels.int4_tune (tuned int4 tables, one lock per shape) and kernels.int4_cuda (the compiled CUDA C module).
The cache is never required: an unusable folder means the work is done again, and no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "XPULORA_KERNEL_CACHE_DIR"


def cache_dir() -> Path | None:
    """Where tuned tables are kept; None when XPULORA_KERNEL_CACHE_DIR=off."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return None if env.lower() == "off" else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xpulora"


def read_json(path: Path) -> dict[str, list]:
    """The JSON object in `path`, or {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_json(path: Path, key: str, value: list) -> None:
    """Set one key of the JSON object in `path`, written atomically (a concurrent reader never sees half a file;
    concurrent writers of one file hold a cache_lock, else one may drop the other's key)."""
    data = read_json(path)
    data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernel_cache_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """An exclusive lock on the file `name` of the cache folder, for work that one process of this machine does
    while the others wait and then read its result from the cache (the OS releases it if its holder dies; no
    cache folder, no lock). Locks never nest the other way round: a shape's tuning (one lock file per shape) may
    compile cuda_mma under its lock, never the reverse."""
    folder = cache_dir()
    fd = None
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # the cache is never required: work without the lock
            log.info("kernel cache lock %s not taken (%s)", name, e)
    if fd is None:
        yield
        return
    try:
        t0 = time.perf_counter()
        fcntl.flock(fd, fcntl.LOCK_EX)
        if (waited := time.perf_counter() - t0) > 0.5:
            log.info("kernel cache: waited %.1f s for another process's %s", waited, name)
        yield
    finally:
        os.close(fd)  # releases the lock
