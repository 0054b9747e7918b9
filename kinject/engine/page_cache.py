"""The kernel's page cache around kinject's own disk reads (``posix_fadvise``).

A benchmark of the disk tier must read from the disk, not from the page cache: it drops the
checkpoint's files before a cold run (:func:`drop_page_cache`), or the store drops exactly the
byte ranges each read used (``pipeline.drop_page_cache``, :func:`drop_read_ranges`). Both are best
effort: a platform without ``posix_fadvise`` or a file that cannot be opened is skipped.
"""

from __future__ import annotations

import os
from typing import Iterable


def drop_page_cache(files: Iterable[str]) -> None:
    """posix_fadvise(DONTNEED) on whole files: the next read hits the disk, not the page cache."""
    _fadvise_dontneed({f: [(0, 0)] for f in files})


def drop_read_ranges(pieces) -> None:
    """posix_fadvise(DONTNEED) on exactly the byte ranges just read. Dropping whole files
    instead would also throw away the kernel's readahead of the next unit's bytes (measured:
    half the read throughput on a single-file checkpoint, see BENCHMARKS.md)."""
    by_file: dict[str, list] = {}
    for p in pieces:
        p = p.located()
        by_file.setdefault(p.file, []).append((p.offset, p.nbytes))
    _fadvise_dontneed(by_file)


def _fadvise_dontneed(ranges: dict[str, list[tuple[int, int]]]) -> None:
    """file -> [(offset, length)] (length 0: to the end); best effort, errors ignored."""
    if not hasattr(os, "posix_fadvise"):
        return
    for f, spans in ranges.items():
        try:
            fd = os.open(f, os.O_RDONLY)
            try:
                for offset, length in spans:
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            pass
