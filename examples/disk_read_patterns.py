"""How fast can one read a checkpoint's experts, and which read pattern gets there?

The measurements behind kinject's disk tier (BENCHMARKS.md, "Disk read patterns"): cold reads
of every expert of a hub-layout (per-expert keys) safetensors checkpoint, page cache dropped
before each pattern, in two orders:

* ``file``: every expert tensor in file order (what a whole-layer read does);
* ``units``: one expert (w1, w2, w3: back to back in the file) at a time, in a random order of
  2 experts per layer per "step" (what batch-1 decoding reads).

Patterns: one ``pread`` per tensor vs one ``preadv`` per expert (kinject's coalesced read);
``posix_fadvise(DONTNEED)`` on the whole file after each read vs on the bytes read; 1 vs 2
reader threads (``pipeline.disk_workers``); and ``POSIX_FADV_RANDOM`` (no kernel readahead).
Columns: GB/s of useful bytes, and bytes the kernel really read per useful byte (readahead
waste) from ``/proc/self/io``.

    python examples/disk_read_patterns.py kinject-bench/mixtral-*/model.safetensors

(``kinject bench offload --workdir kinject-bench`` writes such a checkpoint.)
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import re
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def experts(path: str) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(layer, expert) -> [(absolute offset, nbytes)] of its tensors, sorted by offset."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for key, meta in header.items():
        m = re.search(r"layers\.(\d+)\..*experts\.(\d+)\.", key)
        if m:
            begin, end = meta["data_offsets"]
            out.setdefault((int(m[1]), int(m[2])), []).append((8 + n + begin, end - begin))
    return {k: sorted(v) for k, v in out.items()}


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


class Reader:
    def __init__(self, path: str, *, random_access: bool = False):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        if random_access:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.local = threading.local()

    def buffers(self, sizes):
        have = getattr(self.local, "bufs", None)
        if have is None or len(have) < len(sizes) or any(len(b) < s for b, s in zip(have, sizes)):
            self.local.bufs = have = [mmap.mmap(-1, max(s, 1)) for s in sizes]
        return [memoryview(b)[:s] for b, s in zip(have, sizes)]

    def drop_file(self):
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def read(self, pieces, *, coalesce: bool, drop: str):
        views = self.buffers([nb for _, nb in pieces])
        if coalesce:                       # back to back in the file: one preadv for all
            total, done = sum(nb for _, nb in pieces), 0
            while done < total:
                done += _rest(self.fd, views, pieces[0][0], done)
        else:
            for (off, nb), view in zip(pieces, views):
                done = 0
                while done < nb:
                    done += os.preadv(self.fd, [view[done:]], off + done)
        if drop == "file":
            self.drop_file()
        elif drop == "range":
            for off, nb in pieces:
                os.posix_fadvise(self.fd, off, nb, os.POSIX_FADV_DONTNEED)


def _rest(fd, views, start, done):
    """``preadv`` of what is left after the first ``done`` bytes (a call may read less)."""
    skip, rest = done, []
    for v in views:
        if skip >= len(v):
            skip -= len(v)
            continue
        rest.append(v[skip:])
        skip = 0
    return os.preadv(fd, rest, start + done)


def measure(name, reader: Reader, jobs, useful: int, threads: int, **kw) -> None:
    reader.drop_file()
    b0, t0 = read_bytes(), time.perf_counter()
    if threads == 1:
        for pieces in jobs:
            reader.read(pieces, **kw)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda p: reader.read(p, **kw), jobs))
    dt = time.perf_counter() - t0
    print(f"| {name} | {useful / dt / 1e9:.2f} | {(read_bytes() - b0) / useful:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a hub-layout safetensors file (per-expert keys)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps of the 'units' order")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    table = experts(args.checkpoint)
    if not table:
        raise SystemExit(f"{args.checkpoint}: no per-expert keys (layers.N...experts.E.) found")
    layers = sorted({layer for layer, _ in table})
    n_exp = max(e for _, e in table) + 1
    rng = random.Random(0)
    units = [table[(layer, e)] for _ in range(args.steps) for layer in layers for e in rng.sample(range(n_exp), 2)]
    tensors = [[p] for k in sorted(table) for p in table[k]]
    useful_units = sum(nb for u in units for _, nb in u)
    useful_file = sum(nb for t in tensors for _, nb in t)
    plain, rand = Reader(args.checkpoint), Reader(args.checkpoint, random_access=True)
    print("| pattern | GB/s (useful bytes) | bytes read / useful |\n|---|---|---|")
    for _ in range(args.repeats):
        measure("file order, pread per tensor, drop whole file after each", plain, tensors, useful_file, 1,
                coalesce=False, drop="file")
        measure("file order, pread per tensor, drop bytes read", plain, tensors, useful_file, 1,
                coalesce=False, drop="range")
        measure("experts, pread per tensor, 1 thread", plain, units, useful_units, 1, coalesce=False, drop="range")
        measure("experts, pread per tensor, 2 threads", plain, units, useful_units, 2, coalesce=False, drop="range")
        measure("experts, preadv per expert, 1 thread", plain, units, useful_units, 1, coalesce=True, drop="range")
        measure("experts, preadv per expert, 2 threads (kinject)", plain, units, useful_units, 2,
                coalesce=True, drop="range")
        measure("experts, preadv per expert, 2 threads, FADV_RANDOM", rand, units, useful_units, 2,
                coalesce=True, drop="range")


if __name__ == "__main__":
    main()
