"""Reading an adapter folder's two files: confined to the lora roots under races, bounded, never mmap'ed.

Confinement: the folder is opened once (a directory handle); its real location is read back from the
handle itself (not re-resolved from the path), checked against the roots, and both files are opened
relative to that handle, each again checked by where the opened file really is. A folder or a link
swapped between the check and the reads therefore cannot redirect them: what is read is what was
checked (or the load is refused). Files are opened non-blocking (a FIFO named adapter_config.json
cannot hang the load) and must be regular files.

The weights file is read with plain reads, never memory-mapped: a file truncated by another process
while mapped kills the reading process with SIGBUS, and adapter folders are written by other people's
tools while the server runs. Only the header is read until every tensor's name, shape and dtype has
been checked (and the header must describe exactly the file's size), so a file that declares huge
shapes, or a huge sparse file, is refused before its data is read. The data is then read once; the
checksum and the tensors (decoded by safetensors.torch.load) come from those same bytes.

JSON (the config, the safetensors header) is parsed with bounds: nesting depth, digits per number.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import sys
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from engine.lazy import LazyModule

if TYPE_CHECKING:
    import safetensors.torch
    import torch
else:  # the API process resolves adapter paths only; reading tensors is the engine core's
    safetensors = types.SimpleNamespace(torch=LazyModule("safetensors.torch"))
    torch = LazyModule("torch")

from engine.errors import (
    AdapterError,
    AdapterNotFoundError,
    AdapterPathForbiddenError,
    FileChangedError,
    JSONLimitError,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20  # a peft adapter_config.json is about 1 KiB
MAX_HEADER_BYTES = 16 << 20  # safetensors' own limit is 100 MB; ~150 bytes per tensor in practice
MAX_JSON_DEPTH = 32  # peft configs nest 3 levels deep
MAX_NUMBER_CHARS = 40  # an int64 has 19 digits; longer numbers are refused before int()/float() see them

_ITEM_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


# ----------------------------------------------------------------------------------------------
# bounded JSON


def _parse_number(s: str) -> int | float:
    if len(s) > MAX_NUMBER_CHARS:
        raise JSONLimitError(f"a number of {len(s)} characters (at most {MAX_NUMBER_CHARS} are accepted)")
    return float(s) if any(c in s for c in ".eE") else int(s)


def loads_bounded(raw: bytes) -> Any:
    """json.loads with a nesting limit and a length limit on numbers; JSONLimitError on any problem."""
    try:
        value = json.loads(raw.decode("utf-8"), parse_int=_parse_number, parse_float=_parse_number)
    except RecursionError:
        raise JSONLimitError(f"it nests more than {MAX_JSON_DEPTH} levels deep") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise JSONLimitError(f"it is not valid JSON: {e}") from e
    stack = [(value, 1)]
    while stack:  # the C scanner stops at the interpreter's recursion limit; ours is much lower
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        for c in children:
            if isinstance(c, (dict, list)):
                if depth >= MAX_JSON_DEPTH:
                    raise JSONLimitError(f"it nests more than {MAX_JSON_DEPTH} levels deep")
                stack.append((c, depth + 1))
    return value


# ----------------------------------------------------------------------------------------------
# confined opening


def _fd_path(fd: int) -> str:
    """Where an open file really is (the kernel's answer for the handle, not a re-resolved path)."""
    if sys.platform == "darwin":
        import fcntl

        return os.fsdecode(fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024)).rstrip(b"\0"))
    return os.readlink(f"/proc/self/fd/{fd}")


def _inside(real: str, roots: Sequence[str]) -> bool:
    return any(os.path.commonpath([real, r]) == r for r in roots)


def resolve_under_roots(path: str, roots: Sequence[str]) -> str:
    """The real path of `path` if it lies inside one of `roots` (both resolved, so `..` and symlinks
    cannot escape); a relative path is taken relative to each root in turn. The adapter's two files
    are checked too: a folder inside a root whose files are symlinks to elsewhere is refused. This is the
    early answer; the load checks again on the files it opens (the links can change in between)."""
    if not roots:
        raise AdapterPathForbiddenError("runtime adapter loads are disabled: start the server with --lora-root DIR")
    if "\0" in path:  # os.path raises ValueError on it (was an HTTP 500)
        raise AdapterError(f"adapter path {path!r} contains a NUL character")
    try:
        real_roots = [os.path.realpath(r) for r in roots]
        candidates = [path] if os.path.isabs(path) else [os.path.join(r, path) for r in real_roots]
        reals = [os.path.realpath(c) for c in candidates]
        for real in reals:
            if not _inside(real, real_roots):
                raise AdapterPathForbiddenError(f"adapter path {path} is outside every --lora-root")
        chosen = next((r for r in reals if os.path.exists(r)), reals[0])
        for f in (CONFIG_FILE, WEIGHTS_FILE):
            if not _inside(os.path.realpath(os.path.join(chosen, f)), real_roots):
                raise AdapterPathForbiddenError(f"adapter path {path}: {f} is a link to outside every --lora-root")
    except OSError as e:  # a link replaced while realpath followed it
        raise AdapterNotFoundError(f"adapter path {path} changed while it was being resolved ({e.strerror}); "
                                   "retry") from None
    return chosen


def _stat_sig(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


class AdapterFiles:
    """One adapter folder, opened once: `config` holds the config's bytes (at most MAX_CONFIG_BYTES),
    `weights` the open weights file of `weights_size` bytes. Use as a context manager."""

    def __init__(self, name: str, path: Any, roots: Sequence[str] = ()) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise AdapterNotFoundError(f"adapter {name!r}: no adapter path given")
        self.name, self.shown = name, os.fspath(path)
        if "\0" in self.shown:
            raise AdapterError(f"adapter {name!r}: the path contains a NUL character")
        real_roots = [os.path.realpath(r) for r in roots]
        self._fds: list[int] = []
        try:
            self._dir = self._open(self.shown, os.O_RDONLY | os.O_DIRECTORY, None)
            self.folder = _fd_path(self._dir)
            if real_roots and not _inside(self.folder, real_roots):
                raise AdapterPathForbiddenError(f"adapter path {self.shown} is outside every --lora-root")
            wfd = self._open_file(WEIGHTS_FILE, real_roots)
            self._cfd = self._open_file(CONFIG_FILE, real_roots)
            self._sigs = (_stat_sig(os.fstat(self._cfd)), _stat_sig(os.fstat(wfd)))
            self.config = self._read_config(self._cfd)
            self.weights: BinaryIO = os.fdopen(wfd, "rb")
            self._fds.remove(wfd)  # the file object owns it now
            self.weights_size = self._sigs[1][1]
        except BaseException:
            self.close()
            raise

    def _open(self, rel: str, flags: int, dir_fd: int | None) -> int:
        try:
            fd = os.open(rel, flags | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            if dir_fd is None:
                raise AdapterNotFoundError(f"adapter {self.name!r}: path {self.shown} does not exist") from None
            raise
        except NotADirectoryError:
            raise AdapterNotFoundError(f"adapter {self.name!r}: path {self.shown} is not a directory") from None
        except OSError as e:
            where = self.shown if dir_fd is None else f"{rel} in {self.shown}"
            raise AdapterNotFoundError(f"adapter {self.name!r}: cannot open {where}: {e.strerror}") from None
        self._fds.append(fd)
        return fd

    def _open_file(self, fname: str, roots: Sequence[str]) -> int:
        try:
            fd = self._open(fname, os.O_RDONLY | os.O_NONBLOCK, self._dir)
        except FileNotFoundError:
            if fname == WEIGHTS_FILE and self._exists(PICKLE_FILE):
                raise AdapterError(f"adapter {self.name!r}: {self.shown} holds only {PICKLE_FILE}; "
                                   f"pickled .bin adapters are refused; save with safe_serialization=True") from None
            raise AdapterNotFoundError(f"adapter {self.name!r}: no {fname} in {self.shown}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise AdapterError(f"adapter {self.name!r}: {fname} in {self.shown} is not a regular file")
        if roots and not _inside(_fd_path(fd), roots):
            raise AdapterPathForbiddenError(f"adapter path {self.shown}: {fname} is a link to outside every "
                                            f"--lora-root")
        return fd

    def _exists(self, fname: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(fname, dir_fd=self._dir).st_mode)
        except OSError:
            return False

    def _read_config(self, fd: int) -> bytes:
        size = os.fstat(fd).st_size
        if size > MAX_CONFIG_BYTES:
            raise AdapterError(f"adapter {self.name!r}: {CONFIG_FILE} is {size} bytes; at most {MAX_CONFIG_BYTES} "
                               f"are accepted")
        chunks, got = [], 0
        while chunk := os.read(fd, MAX_CONFIG_BYTES + 1 - got):
            chunks.append(chunk)
            got += len(chunk)
            if got > MAX_CONFIG_BYTES:
                raise FileChangedError(f"adapter {self.name!r}: {CONFIG_FILE} grew while being read; retry")
        return b"".join(chunks)

    def read_weights(self) -> bytearray:
        """All weights_size bytes, or FileChangedError when the file has another size by now."""
        data = bytearray(self.weights_size)
        self.weights.seek(0)
        if self.weights.readinto(data) != self.weights_size or self.weights.read(1):
            raise FileChangedError(f"adapter {self.name!r}: files in {self.shown} changed while being loaded; retry")
        return data

    def check_unchanged(self) -> None:
        """FileChangedError if either file was written, or replaced in the folder, since it was opened."""
        try:
            now = (_stat_sig(os.fstat(self._cfd)), _stat_sig(os.fstat(self.weights.fileno())),
                   *(_stat_sig(os.stat(f, dir_fd=self._dir)) for f in (CONFIG_FILE, WEIGHTS_FILE)))
        except OSError:
            now = ()
        if now != self._sigs * 2:
            raise FileChangedError(f"adapter {self.name!r}: files in {self.shown} changed while being loaded; retry")

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if (w := getattr(self, "weights", None)) is not None:
            w.close()

    def __enter__(self) -> AdapterFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def checksum_bytes(*parts: bytes | bytearray) -> str:
    """sha256 over (length, bytes) of each part: adapter_config.json then adapter_model.safetensors."""
    h = hashlib.sha256()
    for b in parts:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# safetensors without mmap


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Slice:
    def __init__(self, meta: dict[str, Any]) -> None:
        self.meta = meta

    def get_shape(self) -> list[int]:
        return list(self.meta["shape"])

    def get_dtype(self) -> str:
        return str(self.meta["dtype"])


class SafetensorsFile:
    """The subset of safetensors.safe_open's API that the adapter reader uses, over plain reads of an open
    file of `size` bytes (see the module docstring). Opening reads and checks the header only; the first
    get_tensor reads the whole file once into memory, stores it in `snapshot["bytes"]` and decodes every
    tensor from those bytes with safetensors.torch.load."""

    def __init__(self, fh: BinaryIO, size: int, snapshot: dict[str, bytes] | None = None) -> None:
        self._fh, self._size = fh, size
        self._header_raw = self._read_header()
        self._tensors: dict[str, torch.Tensor] | None = None
        self._snapshot = snapshot if snapshot is not None else {}

    def _read_header(self) -> bytes:
        self._fh.seek(0)
        head = self._fh.read(8)
        if len(head) < 8:
            raise ValueError(f"file of {self._size} bytes is too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > self._size:
            raise ValueError(f"declared header length {n} exceeds the file ({self._size} bytes) or the limit "
                             f"of {MAX_HEADER_BYTES} bytes")
        raw = self._fh.read(n)
        try:
            header = loads_bounded(raw)
        except JSONLimitError as e:
            raise ValueError(f"corrupt header: {e}") from e
        if not isinstance(header, dict):
            raise ValueError("corrupt header: not a JSON object")
        header.pop("__metadata__", None)
        spans: list[tuple[int, int]] = []
        for key, meta in header.items():
            dt, shape, offs = (meta.get(k) if isinstance(meta, dict) else None
                               for k in ("dtype", "shape", "data_offsets"))
            if (not isinstance(dt, str) or not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape)
                    or not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs)):
                raise ValueError(f"corrupt header entry for {key!r}: {meta!r}"[:300])
            if dt in _ITEM_SIZES and offs[1] - offs[0] != math.prod(shape) * _ITEM_SIZES[dt]:
                raise ValueError(f"tensor {key!r}: data_offsets {offs} do not match shape {shape} and dtype {dt}")
            spans.append((offs[0], offs[1]))
        # Like safetensors: the tensors tile the data region exactly (no gap, no overlap, nothing after),
        # so the file's size is what the (checked) shapes say and nothing else is ever read.
        end = 0
        for b, e in sorted(spans):
            if b != end or e < b:
                raise ValueError(f"tensor data offsets overlap or leave a gap at byte {end}")
            end = e
        if 8 + n + end != self._size:
            raise ValueError(f"the header describes {8 + n + end} bytes but the file has {self._size} "
                             "(truncated, or data after the tensors)")
        self._header = header
        return head + raw

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        pass  # the caller owns the file

    def keys(self) -> list[str]:
        return list(self._header)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self._header[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        if self._tensors is None:
            self._fh.seek(0)
            data = self._fh.read(self._size)
            if len(data) != self._size or self._fh.read(1) or data[: len(self._header_raw)] != self._header_raw:
                raise FileChangedError("the file changed while being loaded; retry")
            self._snapshot["bytes"] = data
            self._tensors = safetensors.torch.load(data)
        return self._tensors[key]


def safe_open(fh: BinaryIO, size: int, framework: str = "pt",
              snapshot: dict[str, bytes] | None = None) -> SafetensorsFile:
    """Stand-in for safetensors.safe_open (framework "pt" only) over an open file, without mmap."""
    if framework != "pt":
        raise ValueError(f"framework {framework!r} is not supported")
    return SafetensorsFile(fh, size, snapshot)
