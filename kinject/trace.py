"""Timeline of compute and transfer events.

Every compute step and every transfer is a :class:`TraceEvent` on a named stream
(``compute``, ``prefetch``, ``ondemand``, ``kv_load``, ``kv_store``, ``disk``). The
:class:`Tracer` collects them from any thread and turns them into a Chrome/Perfetto
trace, bubble statistics (idle share of the compute stream) and bytes moved per tier.

Timing. Host times come from ``time.perf_counter`` relative to the tracer's origin. On a
CUDA device, :meth:`Tracer.span` records a pair of ``torch.cuda.Event`` on the *current*
CUDA stream and resolves them only when events are read, so tracing never synchronizes
in the hot path. GPU times are aligned to the host clock through one reference event,
recorded (and waited for, once) at creation and at :meth:`Tracer.clear`::

    t_host(ev) = ref_host + ref_event.elapsed_time(ev) / 1000

A disabled tracer costs one attribute test per call.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger(__name__)

#: Streams in display order; any other stream name is allowed and shown after these.
STREAMS = ("compute", "host_compute", "prefetch", "ondemand", "kv_load", "kv_store", "disk")

# Pending CUDA spans beyond this count are resolved opportunistically (non-blocking query).
_PENDING_DRAIN = 4096


@dataclass
class TraceEvent:
    """One interval on one stream; times in seconds relative to the tracer's origin."""

    stream: str
    name: str
    start: float
    end: float
    kind: str = "compute"          # "compute" | "transfer"
    layer: int | None = None
    nbytes: int = 0
    tier: str | None = None        # source tier of a transfer: "host" | "disk" | "device"
    args: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class _PendingSpan:
    """A CUDA-timed span whose events have not been read back yet (times filled in later)."""

    event: TraceEvent
    start_ev: "torch.cuda.Event"
    end_ev: "torch.cuda.Event"


_NO_SPAN = nullcontext()


class Tracer:
    """Thread-safe collector of :class:`TraceEvent`.

    ``device``: where :meth:`span` measures. ``cuda`` devices time spans with CUDA events on
    the current stream (GPU time); anything else with ``perf_counter`` (host time).
    """

    def __init__(self, enabled: bool = True, device: torch.device | str = "cpu"):
        self.enabled = enabled
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._lock = threading.Lock()            # guards _events and _pending
        self._resolve_lock = threading.Lock()    # one resolver at a time
        self._events: list[TraceEvent] = []
        self._counters: dict[str, list[tuple[float, float]]] = {}   # name -> (time, value) samples
        self._steps: list[tuple[float, float]] = []                 # (start, end) of each model forward
        self._pending: list[_PendingSpan] = []
        self._ref_event = None                   # CUDA reference event (time zero on the GPU side)
        self._ref_host = 0.0
        self._origin = time.perf_counter()
        if enabled:
            self._reset_reference()

    # ------------------------------------------------------------------ recording

    def now(self) -> float:
        """Seconds since the tracer's origin (host clock)."""
        return time.perf_counter() - self._origin

    def at(self, perf_counter: float) -> float:
        """A ``time.perf_counter()`` reading on this tracer's clock (seconds since its origin)."""
        return perf_counter - self._origin

    def counter(self, name: str, value: float) -> None:
        """Sample a value over time (e.g. ``device_bytes`` from the store's accounting)."""
        if not self.enabled:
            return
        with self._lock:
            self._counters.setdefault(name, []).append((self.now(), float(value)))

    def counters(self) -> dict[str, list[tuple[float, float]]]:
        with self._lock:
            return {k: list(v) for k, v in self._counters.items()}

    def mark_step(self, start: float, end: float) -> None:
        """One model forward (a prefill or a decode step) ran from ``start`` to ``end`` (host clock)."""
        if not self.enabled:
            return
        with self._lock:
            self._steps.append((start, end))

    def steps(self) -> list[tuple[float, float]]:
        with self._lock:
            return list(self._steps)

    def record(self, stream: str, name: str, start: float, end: float, **fields) -> None:
        """Append one event; ``fields`` are the other :class:`TraceEvent` fields."""
        if not self.enabled:
            return
        ev = TraceEvent(stream, name, start, end, **fields)
        with self._lock:
            self._events.append(ev)

    def span(self, stream: str, name: str, **fields):
        """Time the enclosed block as one event (also when it raises). Disabled: one shared
        do-nothing context (no generator, no event), so an untraced run pays a call, not a span."""
        if not self.enabled:
            return _NO_SPAN
        return self._span(stream, name, fields)

    @contextmanager
    def _span(self, stream: str, name: str, fields: dict) -> Iterator[None]:
        if self._cuda:
            if self._ref_event is None:
                self._reset_reference()
            ev = TraceEvent(stream, name, 0.0, 0.0, **fields)     # checks the fields now
            cur = torch.cuda.current_stream(self.device)
            start_ev = torch.cuda.Event(enable_timing=True)
            start_ev.record(cur)
            try:
                yield
            finally:
                end_ev = torch.cuda.Event(enable_timing=True)
                end_ev.record(torch.cuda.current_stream(self.device))
                with self._lock:
                    self._pending.append(_PendingSpan(ev, start_ev, end_ev))
                    drain = len(self._pending) > _PENDING_DRAIN
                if drain:
                    self._resolve(block=False)
        else:
            start = self.now()
            try:
                yield
            finally:
                self.record(stream, name, start, self.now(), **fields)

    def clear(self) -> None:
        with self._lock:
            self._counters = {}
            self._steps = []
        self._clear_events()

    def _clear_events(self) -> None:
        """Drop every event (pending CUDA spans included) and restart the clock at zero."""
        with self._resolve_lock, self._lock:
            self._events.clear()
            self._pending.clear()
            if self.enabled:
                self._reset_reference()

    def _reset_reference(self) -> None:
        """New origin; on CUDA also a reference event taken at (almost) the same instant.

        The reference event is waited for once so that its GPU timestamp matches the host
        time taken right after; this happens at creation/clear only, never in the hot path.
        """
        if self._cuda:
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(torch.cuda.current_stream(self.device))
            ref.synchronize()
            self._origin = time.perf_counter()
            self._ref_host = 0.0
            self._ref_event = ref
        else:
            self._origin = time.perf_counter()

    def _resolve(self, block: bool = True) -> None:
        """Turn pending CUDA spans into events; ``block=False`` takes only finished ones."""
        if not self._pending:
            return
        if not self._resolve_lock.acquire(blocking=block):
            return                          # someone else is resolving; the hot path moves on
        try:
            with self._lock:
                pending, self._pending = self._pending, []
            done: list[TraceEvent] = []
            keep: list[_PendingSpan] = []
            ref = self._ref_event
            for p in pending:
                if not block and not (p.start_ev.query() and p.end_ev.query()):
                    keep.append(p)
                    continue
                p.start_ev.synchronize()    # waits for these two events only
                p.end_ev.synchronize()
                p.event.start = self._ref_host + ref.elapsed_time(p.start_ev) / 1000.0
                p.event.end = self._ref_host + ref.elapsed_time(p.end_ev) / 1000.0
                done.append(p.event)
            with self._lock:
                self._events.extend(done)
                self._pending[:0] = keep
        finally:
            self._resolve_lock.release()

    # ------------------------------------------------------------------ reading

    def events(self) -> list[TraceEvent]:
        """All events, pending CUDA spans resolved, sorted by start time."""
        self._resolve()
        with self._lock:
            evs = list(self._events)
        evs.sort(key=lambda e: (e.start, e.end))
        return evs

    def bubble_fraction(self, stream: str = "compute",
                        window: tuple[float, float] | None = None) -> float:
        """Idle share of ``stream`` over ``window`` (default: its first start to last end).

        Overlapping events are merged, so busy time is never counted twice. Returns 0.0
        when the span is empty (no events and no window).
        """
        spans = [(e.start, e.end) for e in self.events() if e.stream == stream]
        if window is not None:
            lo, hi = window
            spans = [(max(s, lo), min(e, hi)) for s, e in spans]
            spans = [(s, e) for s, e in spans if e > s]
        elif spans:
            lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
        else:
            return 0.0
        total = hi - lo
        if total <= 0:
            return 0.0
        return max(0.0, 1.0 - union_seconds(spans) / total)

    def bytes_by_tier(self) -> dict[str, int]:
        """Transfer bytes summed by source tier (``"unknown"`` when a transfer names none)."""
        out: dict[str, int] = defaultdict(int)
        for e in self.events():
            if e.kind == "transfer":
                out[e.tier or "unknown"] += e.nbytes
        return dict(out)

    def bytes_by_stream(self) -> dict[str, int]:
        """Transfer bytes summed by stream."""
        out: dict[str, int] = defaultdict(int)
        for e in self.events():
            if e.kind == "transfer":
                out[e.stream] += e.nbytes
        return dict(out)

    def summary(self) -> dict:
        """Busy seconds per stream (overlaps merged), compute bubble fraction, bytes, counts."""
        evs = self.events()
        by_stream: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for e in evs:
            by_stream[e.stream].append((e.start, e.end))
        return {
            "busy_s": {s: union_seconds(v) for s, v in _ordered(by_stream).items()},
            "wall_s": (max(e.end for e in evs) - min(e.start for e in evs)) if evs else 0.0,
            "bubble_fraction": self.bubble_fraction("compute"),
            "bytes_by_tier": self.bytes_by_tier(),
            "bytes_by_stream": self.bytes_by_stream(),
            "event_counts": {s: len(v) for s, v in _ordered(by_stream).items()},
        }

    # ------------------------------------------------------------------ export

    def to_chrome(self, path: str | Path) -> None:
        """Write a Chrome/Perfetto trace: one thread (tid) per stream, times in microseconds."""
        evs = self.events()
        streams = list(_ordered({e.stream: None for e in evs}))
        tids = {s: i + 1 for i, s in enumerate(streams)}
        out: list[dict] = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0,
                            "args": {"name": "kinject"}}]
        for s, tid in tids.items():
            out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": s}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid,
                        "args": {"sort_index": tid}})
        for e in evs:
            out.append({
                "name": e.name, "cat": e.kind, "ph": "X", "pid": 1, "tid": tids[e.stream],
                "ts": e.start * 1e6, "dur": max(0.0, e.end - e.start) * 1e6,
                "args": {"layer": e.layer, "nbytes": e.nbytes, "tier": e.tier, **e.args},
            })
        for name, samples in self.counters().items():
            out.extend({"name": name, "ph": "C", "pid": 1, "ts": t * 1e6, "args": {name: v}} for t, v in samples)
        steps = self.steps()
        if steps:                 # one model forward each, on a track of their own
            out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "steps"}})
            out.extend({"name": f"step {i}", "cat": "step", "ph": "X", "pid": 1, "tid": 0, "ts": a * 1e6,
                        "dur": (b - a) * 1e6} for i, (a, b) in enumerate(steps))
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f, default=str)

    def plot(self, path: str | Path, *, title: str | None = None, budget: int | None = None) -> bool:
        """Draw the pipeline to a PNG, like Klotski's Figure 15; False (and one logged line) when
        matplotlib cannot be imported.

        Top: the whole run, a lane per stream, model forwards banded and numbered. Middle: one
        decode step (the median-length one) zoomed: a lane per stream with every event coloured by
        its layer, above them the span of each layer's compute and its phases (attention, gate,
        experts) labelled, the compute lane's idle gaps (bubbles) shaded. Bottom: device memory
        over the run (store accounting), the zoomed step marked, ``budget`` (bytes) as a line.
        """
        try:
            import matplotlib
            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except Exception as exc:      # noqa: BLE001 - a missing or broken matplotlib costs the picture only
            log.warning("kinject: no plot drawn (matplotlib: %s: %s); pip install matplotlib",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return False
        evs = self.events()
        streams = list(_ordered({e.stream: None for e in evs}))
        steps = self.steps()
        zoom = _zoom_step(steps)
        memory = self.counters().get("device_bytes")
        lanes = max(1, len(streams))
        ratios = ([0.3 * lanes + 0.9] + ([0.5 * (lanes + 2) + 1.0] if zoom else []) + ([1.4] if memory else []))
        fig, axes = plt.subplots(len(ratios), 1, figsize=(13, sum(ratios) + 1.0),
                                 gridspec_kw={"height_ratios": ratios}, squeeze=False)
        axes = list(axes[:, 0])
        over = axes.pop(0)
        _draw_overview(over, evs, streams, steps)
        over.set_title(title or "kinject pipeline", loc="left", fontsize=11)
        if zoom:
            ax = axes.pop(0)
            lo, hi = zoom
            _draw_step(ax, [e for e in evs if e.end > lo and e.start < hi], streams, zoom)
            bubble = self.bubble_fraction("compute", window=zoom)
            ax.set_title(f"zoom on one decode step (forward {steps.index(zoom)}, {(hi - lo) * 1e3:.1f} ms, gold above): "
                         f"compute idle {bubble:.0%} of it (shaded red); colour = layer",
                         loc="left", fontsize=10)
            for a in [over] + axes:
                a.axvspan(lo * 1e3, hi * 1e3, color="gold", alpha=0.45, lw=0, zorder=0.5)
        if memory:
            ax = axes.pop(0)
            ts, vs = zip(*memory)
            ax.step([t * 1e3 for t in ts], [v / 2**20 for v in vs], where="post", color="tab:blue", lw=0.8)
            ax.set_ylabel("device MiB")
            if budget:
                ax.axhline(budget / 2**20, color="tab:red", ls="--", lw=1)
                ax.text(over.get_xlim()[0], budget / 2**20, " device_budget", color="tab:red", va="bottom", fontsize=7)
            ax.set_ylim(bottom=0, top=max(max(vs), budget or 0) / 2**20 * 1.15)
            ax.set_xlim(over.get_xlim())
            ax.set_xlabel("time (ms), whole run: device memory (store accounting)")
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return True


_LANE_COLORS = {"compute": "tab:blue", "prefetch": "tab:orange", "ondemand": "tab:red", "kv_load": "tab:green",
                "kv_store": "tab:purple", "disk": "tab:brown", "stall": "tab:gray"}
_LANE_NAMES = {"stall": "stall (compute waits)"}
_PHASE_LABELS = {"attention": ("attn", "a"), "experts": ("experts", "exp", "e"), "gate": ("gate", "g")}


def _zoom_step(steps: list[tuple[float, float]]) -> tuple[float, float] | None:
    """The median-length decode step (every forward after the first), else the only one."""
    decode = steps[1:] or steps
    if not decode:
        return None
    return sorted(decode, key=lambda s: s[1] - s[0])[len(decode) // 2]


def _draw_overview(ax, evs, streams, steps) -> None:
    """The whole run: a lane per stream in its colour, model forwards banded and numbered (P: prefill)."""
    for row, s in enumerate(streams):
        ax.broken_barh([(e.start * 1e3, (e.end - e.start) * 1e3) for e in evs if e.stream == s], (row - 0.4, 0.8),
                       color=_LANE_COLORS.get(s, "tab:gray"))
    every = max(1, len(steps) // 24)
    for i, (a, b) in enumerate(steps):
        if i % 2 == 0:
            ax.axvspan(a * 1e3, b * 1e3, color="0.88", lw=0, zorder=0)
        if i % every == 0:
            ax.text((a + b) / 2 * 1e3, -0.65, "P" if i == 0 else str(i), ha="center", va="bottom", fontsize=7)
    ax.set_yticks(range(len(streams)), [_LANE_NAMES.get(s, s) for s in streams], fontsize=8)
    ax.set_ylim(len(streams) - 0.5, -1.1)
    ax.set_xlabel("time (ms), whole run; bands: model forwards (P = prefill, then decode steps 1, 2, ...)", fontsize=8)


def _phase(name: str) -> str:
    """The phase of a compute event, from its module path: attention, gate, experts, or the module's name."""
    path = name.split(" ")[0]
    last = path.rsplit(".", 1)[-1]
    if "attn" in last or "attention" in last:
        return "attention"
    if last in ("gate", "router") or last.endswith("_gate"):
        return "gate"
    if last.startswith("experts") or "expert" in last:
        return "experts"
    return last


def _phases(compute) -> list[tuple[int | None, str, float, float]]:
    """Consecutive compute events of one (layer, phase): (layer, phase, start, end)."""
    out: list[list] = []
    for e in sorted(compute, key=lambda e: e.start):
        key = (e.layer, _phase(e.name))
        if out and tuple(out[-1][:2]) == key:
            out[-1][3] = max(out[-1][3], e.end)
        else:
            out.append([e.layer, key[1], e.start, e.end])
    return [tuple(g) for g in out]


def _draw_step(ax, evs, streams, window) -> None:
    """One step: a ``layers`` lane (each layer's compute span, labelled), a ``phases`` lane
    (attention / gate / experts of each layer), then a lane per stream, every event coloured by
    its layer; idle gaps of the compute lane shaded."""
    import matplotlib
    from matplotlib.patches import Patch

    lo, hi = (t * 1e3 for t in window)
    width = hi - lo
    layers = sorted({e.layer for e in evs if e.layer is not None})
    palette = matplotlib.colormaps["tab10" if len(layers) <= 10 else "tab20"]
    shade = {layer: palette(i % palette.N) for i, layer in enumerate(layers)}
    compute = [e for e in evs if e.stream == "compute"]
    groups = _phases(compute)
    names = ["layers", "phases"] + [_LANE_NAMES.get(s, s) for s in streams]
    spans: dict = {}
    for layer, _, a, b in groups:
        if layer is not None:
            s0, s1 = spans.get(layer, (a, b))
            spans[layer] = (min(s0, a), max(s1, b))
    for layer, (a, b) in spans.items():
        a, b = max(a * 1e3, lo), min(b * 1e3, hi)
        ax.broken_barh([(a, b - a)], (-0.35, 0.7), facecolor=shade[layer], alpha=0.35, edgecolor=shade[layer])
        for label in (f"layer {layer}", f"L{layer}"):                     # the longest that fits
            if b - a > 0.0075 * width * (len(label) + 1):
                ax.text((a + b) / 2, 0, label, ha="center", va="center", fontsize=8, fontweight="bold")
                break
    for layer, phase, a, b in groups:
        a, b = max(a * 1e3, lo), min(b * 1e3, hi)
        color = shade.get(layer, "0.6")
        ax.broken_barh([(a, b - a)], (0.65, 0.7), facecolor=color, alpha=0.6, edgecolor="white", linewidth=0.5)
        for label in _PHASE_LABELS.get(phase, (phase, phase[:1])):     # the longest that fits
            if b - a > 0.0065 * width * (len(label) + 1):
                ax.text((a + b) / 2, 1, label, ha="center", va="center", fontsize=7)
                break
    for row, s in enumerate(streams, start=2):
        mine = [e for e in evs if e.stream == s]
        if s == "compute":
            for a, b in _gaps([(e.start, e.end) for e in mine], window):
                ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (row - 0.45, 0.9), facecolor="tab:red", alpha=0.18,
                               linewidth=0)
        ax.broken_barh([(e.start * 1e3, (e.end - e.start) * 1e3) for e in mine], (row - 0.4, 0.8),
                       facecolors=[shade.get(e.layer, _LANE_COLORS.get(s, "tab:gray")) for e in mine],
                       edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(lo, hi)
    ax.set_xlabel("time (ms), one decode step", fontsize=8)
    handles = [Patch(color=shade[layer], label=f"layer {layer}") for layer in layers]
    handles.append(Patch(facecolor="tab:red", alpha=0.18, label="compute idle (bubble)"))
    ax.legend(handles=handles, ncol=min(len(handles), 9), fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.16), frameon=False)


def _gaps(spans: list[tuple[float, float]], window: tuple[float, float]) -> list[tuple[float, float]]:
    """The idle intervals of ``spans`` inside ``window``."""
    lo, hi = window
    out, cur = [], lo
    for s, e in sorted(spans):
        s, e = max(s, lo), min(e, hi)
        if e <= cur:
            continue
        if s > cur:
            out.append((cur, s))
        cur = e
    if cur < hi:
        out.append((cur, hi))
    return out


def union_seconds(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _ordered(d: dict) -> dict:
    """``d`` with the known streams first (in :data:`STREAMS` order), others after, by name."""
    known = [s for s in STREAMS if s in d]
    rest = sorted(s for s in d if s not in STREAMS)
    return {s: d[s] for s in known + rest}
