"""Measured costs that decide where an expert computes (Fiddler's rule, HybriMoE's per-step choice).

An expert the device does not hold can be *moved* (its stored bytes over the host->device link,
then computed by the device) or *computed where it lives* (its routed rows' activations over the
link, a host kernel, the outputs back). :class:`PlacementCosts` holds what that choice needs, all
measured on this machine, per runtime:

* ``host`` / ``device``: :class:`LineFit` lines ``seconds = fixed + per_row * rows`` of one expert's
  compute on each side, fitted from every grouped compute the experts operators time (a group of
  ``g`` experts and ``n`` rows in ``s`` seconds is the point ``(n / g, s / g)``, as the planner's
  profiler fits the device line from the trace); seeded once by a short calibration of each
  side's kernel before the first choice, so the first step is decided from measurements too;
* ``link``: bytes/s of the host->device link: the emulated rate where the link is emulated (it
  runs at exactly that rate), else the rate the transfer engine's copies reached;
* ``same_cores``: the "device" is the host's own cores (a CPU runtime, its link emulated): an
  expert computed on the host runs the same kernel on the same cores and tensors as a moved one,
  so the compute terms of both sides are one cost and cancel. The choice is then the link's alone
  (the rows' activations both ways vs. the expert's bytes): two lines fitted apart, under a
  changing load, made it flip on noise and move experts that only added link time.

The planner reads the same numbers into its :class:`~kinject.plan.profile.Profile`
(``t_host_expert``), so ``kinject plan`` and the running model decide from one measurement.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class LineFit:
    """Running least-squares line ``seconds(rows) = fixed_s + per_row_s * rows`` (``rows = 0``: 0 s).

    Points are kept as sums (constant memory); the newest ``window`` points weigh as much as all
    older ones together (the sums halve when they reach it), so a machine that speeds up or slows
    down (warm caches, another process) is followed within a few steps."""

    window: int = 256
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    #: a point above this multiple of the line's prediction counts as that multiple: a thread
    #: descheduled mid-kernel (a busy machine) or a kernel's one-time set-up, not the kernel's cost
    clip: float = 4.0

    def add(self, rows: float, seconds: float) -> None:
        if rows <= 0 or seconds < 0:
            return
        if self.n >= 2:                    # (per expert group per step: conditionals, not min / max calls)
            a, b = self.coefficients()
            line = a + b * rows
            cap = self.clip * (line if line > 1e-9 else 1e-9)
            if seconds > cap:
                seconds = cap
        if self.n >= self.window:
            self.n, self.sx, self.sy, self.sxx, self.sxy = (v / 2 for v in (self.n, self.sx, self.sy, self.sxx, self.sxy))
        self.n += 1
        self.sx += rows
        self.sy += seconds
        self.sxx += rows * rows
        self.sxy += rows * seconds

    @property
    def known(self) -> bool:
        return self.n > 0

    def coefficients(self) -> tuple[float, float]:
        """(fixed_s, per_row_s), both >= 0; one distinct row count: a line through the origin."""
        if not self.n:
            return 0.0, 0.0
        var = self.sxx - self.sx * self.sx / self.n
        if var <= 1e-12 * (self.sxx if self.sxx > 1.0 else 1.0):
            return 0.0, self.sy / self.sx if self.sx else 0.0
        b = (self.sxy - self.sx * self.sy / self.n) / var
        b = b if b > 0.0 else 0.0
        a = (self.sy - b * self.sx) / self.n
        return (a if a > 0.0 else 0.0), b

    def __call__(self, rows: float) -> float:
        if rows <= 0:
            return 0.0
        a, b = self.coefficients()
        return a + b * rows


@dataclass
class PlacementCosts:
    """What deciding host vs. device needs, measured (module docstring). Thread-safe adds: a CUDA
    host worker reports its timings from its own thread."""

    link_bytes_per_s: float | None = None          # host->device; None until known
    emulated: bool = False
    same_cores: bool = False                       # device compute is host compute (module docstring)
    version: int = 0                               # counts the points added: a cached decision is stale when it moves
    host: LineFit = field(default_factory=LineFit)
    device: LineFit = field(default_factory=LineFit)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, side: str, experts: int, rows: int, seconds: float) -> None:
        """A grouped compute of ``experts`` experts over ``rows`` rows took ``seconds`` on ``side``."""
        if experts <= 0:
            return
        fit = self.host if side == "host" else self.device
        with self._lock:
            fit.add(rows / experts, seconds / experts)
            self.version += 1

    def move_s(self, nbytes: int) -> float:
        """Seconds the link needs for ``nbytes`` (inf while the rate is unknown: nothing is moved
        on a guess, the caller calibrates first)."""
        rate = self.link_bytes_per_s
        return nbytes / rate if rate else float("inf")

    def host_wins(self, rows: int, unit_bytes: int, row_bytes: int, *, same_kernel: bool = True) -> bool:
        """Fiddler's rule for one expert with ``rows`` routed rows: computing it where it lives
        (its rows' activations in and out over the link, ``2 * rows * row_bytes``, and the host
        kernel) is cheaper than moving its ``unit_bytes`` and computing it on the device. On
        :attr:`same_cores` with the device's own kernel on the host (``same_kernel``) both compute
        terms are the same and cancel: activations vs. weights on the link (a tie moves: Klotski's
        path, one grouped call)."""
        rows_s, move = self.move_s(2 * rows * row_bytes), self.move_s(unit_bytes)
        if self.same_cores and same_kernel:
            return rows_s < move
        return self.host(rows) + rows_s < move + self.device(rows)

    def summary(self) -> dict:
        ha, hb = self.host.coefficients()
        da, db = self.device.coefficients()
        return {"link_bytes_per_s": self.link_bytes_per_s, "emulated": self.emulated, "same_cores": self.same_cores,
                "host": {"fixed_s": ha, "per_row_s": hb, "points": self.host.n},
                "device": {"fixed_s": da, "per_row_s": db, "points": self.device.n}}
