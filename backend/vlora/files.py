"""Reading a file once, safely and within a size limit: a leaf module (the standard library only) that every
package may import (adapters, task heads, model folders).

A file is opened once, without following a final symlink (``O_NOFOLLOW``: a symlink swapped in after the
caller checked the path is refused), checked to be a regular file on that descriptor, and read front to
back through it: the bytes read are the bytes parsed, and nothing is read again by path. :func:`json_object`
parses such bytes as one JSON object.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, Optional

CHUNK = 1 << 30  # one read() for most adapters: no copies to join them (Linux reads at most ~2 GiB at once)


class NotARegularFile(OSError):
    """The path is a symlink (swapped in after it was checked), a folder, a device or a fifo."""


class FileTooLarge(ValueError):
    """The file holds more bytes than the caller's limit (``size``: at least that many)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size} bytes, more than {limit}")
        self.size = size
        self.limit = limit


class OneRead:
    """One file, opened once and read front to back; ``read`` returns the next bytes.

    ``size`` is the size when it was opened (fstat on the descriptor); the file may change afterwards,
    which only changes what the reads return, never which file they read.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            self._fd: Optional[int] = os.open(self.path, flags)  # O_NONBLOCK: a fifo swapped in does not block the open
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EMLINK):  # Linux, BSD: a symlink where a file was checked
                raise NotARegularFile(f"{self.path.name} is a symlink") from None
            raise
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotARegularFile(f"{self.path.name} is not a regular file")
            os.set_blocking(self._fd, True)
        except BaseException:
            self.close()
            raise
        self.size = st.st_size

    def read(self, n: int) -> bytes:
        """The next ``n`` bytes, fewer only at the end of the file."""
        parts = []
        while n > 0:
            chunk = os.read(self._fd, min(n, CHUNK))
            if not chunk:
                break
            parts.append(chunk)
            n -= len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_rest(self, limit: int) -> bytes:
        """Everything up to the end of the file; FileTooLarge when that is more than ``limit`` bytes (the
        file may have grown since it was opened: at most ``limit + 1`` bytes are read)."""
        data = self.read(limit + 1)
        if len(data) > limit:
            raise FileTooLarge(max(self.size, len(data)), limit)
        return data

    def read_all(self, limit: int) -> "np.ndarray":
        """The whole file as a writable uint8 array, read again from its start (a caller checks that what it
        read first is its prefix); FileTooLarge past ``limit`` bytes, as ``read_rest``. Read straight into one
        uninitialised buffer: the kernel's copy is the only one, made with the GIL released, and tensors can be
        views of it (``bytes`` from ``read`` would be one more copy, and a ``bytearray`` is zeroed first under the GIL)."""
        import numpy as np

        buf = np.empty(min(limit, self.size) + 1, dtype=np.uint8)  # one byte over the size at open: growth fills it
        got = self.read_into(buf)
        if got == len(buf):  # the file grew since it was opened: the rest the slow way, up to the limit
            if got > limit:
                raise FileTooLarge(max(self.size, got), limit)
            return np.concatenate([buf, np.frombuffer(self.read_rest(limit - got), dtype=np.uint8)])
        return buf[:got]

    def read_into(self, buf) -> int:
        """Read the file from its start into the writable buffer ``buf`` until it is full or the file ends; the bytes
        read. The kernel copies straight into ``buf``, with the GIL released."""
        os.lseek(self._fd, 0, os.SEEK_SET)
        view = memoryview(buf).cast("B")
        got = 0
        try:
            while got < len(view):
                n = os.readv(self._fd, [view[got:]])
                if n == 0:
                    break
                got += n
        finally:
            view.release()
        return got

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OneRead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_once(path: Path, limit: int) -> bytes:
    """The bytes of ``path``, read once through one descriptor (see :class:`OneRead`); FileTooLarge when
    it holds more than ``limit`` bytes (refused from its size before anything is read)."""
    with OneRead(path) as f:
        if f.size > limit:
            raise FileTooLarge(f.size, limit)
        return f.read_rest(limit)


def json_object(raw: bytes, filename: str) -> dict[str, Any]:
    """``raw`` (a file's bytes) parsed as UTF-8 JSON that must hold an object; ValueError naming ``filename``
    and the problem, for the caller to raise as its own error type."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError included
        raise ValueError(f"{filename} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{filename} must hold a JSON object")
    return value
