"""Reading an adapter's files once, and the version that names what was read.

Each file is opened once, without following a final symlink (``O_NOFOLLOW``: a symlink swapped in after
the loader checked the path is refused), checked to be a regular file on that descriptor, and read front
to back through it. The bytes read are the bytes parsed and the bytes hashed: nothing is read again by
path, and no ``stat`` is taken after the read, so a file overwritten or replaced while it is read cannot
pair one content with another's version.

The version (:func:`content_version`) is a sha256 over each file's name, length and bytes, in the order
the loader read them. It names the content, not the file: weights overwritten in place with the same
size and the mtime restored (``cp -p``, a sync tool) get a new version, and an unchanged reload keeps
its version. Keeping it is right: the same bytes give the same weights, bit for bit, so the keys and
values and encoder features cached for them are still the ones a fresh server would compute. (A counter
bumped on every load would only throw those away.) sha256 because it is the fastest hash in hashlib on
CPUs with the SHA extensions (x86 SHA-NI, ARMv8 SHA2): about 1.3 GB/s on one core of a shared Xeon,
against 0.5 GB/s for blake2b; hashlib releases the GIL while it hashes, so the engine thread keeps
stepping meanwhile.
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import Iterable, Optional

CHUNK = 1 << 30  # one read() for most adapters: no copies to join them (Linux reads at most ~2 GiB at once)
_VERSION_DOMAIN = b"vlora-adapter\0"


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

    def read_all(self, limit: int) -> bytes:
        """The whole file, read again from its start (a caller checks that what it read first is its prefix);
        FileTooLarge past ``limit`` bytes, as ``read_rest``."""
        os.lseek(self._fd, 0, os.SEEK_SET)
        return self.read_rest(limit)

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


class ContentVersion:
    """The version of an adapter, built as its files are read: ``add`` each (file name, bytes read) in
    load order, then ``hexdigest``. The sha256, in hex, of a domain tag, then per file its name, a NUL, its
    length (8 bytes, little-endian) and its bytes; the names and lengths keep two splits of the same bytes
    from meeting. Hashing as each file is read lets its bytes go once they are parsed."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(_VERSION_DOMAIN)

    def add(self, name: str, data: bytes) -> None:
        self._h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def content_version(files: Iterable[tuple[str, bytes]]) -> str:
    """The version of an adapter read as ``files`` ((file name, bytes read) in load order); see
    :class:`ContentVersion`."""
    v = ContentVersion()
    for name, data in files:
        v.add(name, data)
    return v.hexdigest()
