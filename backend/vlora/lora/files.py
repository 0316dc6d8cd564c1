"""Reading an adapter's files once (through :mod:`vlora.files`), and the version that names what was read.

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

import hashlib
from typing import Iterable

from vlora.files import CHUNK, FileTooLarge, NotARegularFile, OneRead, read_once

__all__ = ["CHUNK", "ContentVersion", "FileTooLarge", "NotARegularFile", "OneRead", "content_version", "read_once"]

_VERSION_DOMAIN = b"vlora-adapter\0"


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
