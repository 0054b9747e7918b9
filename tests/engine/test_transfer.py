"""Transfer engine: ordering, concurrency, emulated link, faults, lifecycle (CPU) + one GPU test."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from kinject.errors import TransferError
from kinject.trace import Tracer
from kinject.engine.transfer import CHANNELS, TransferEngine

T = 5.0   # generous timeout for waits that should succeed at once; a hang fails instead of blocking


@pytest.fixture
def engine():
    with TransferEngine("cpu", tracer=Tracer()) as eng:
        yield eng


def _overlap(a, b) -> bool:
    return max(a.start, b.start) < min(a.end, b.end)


def test_fifo_within_a_channel(engine):
    seen = []
    handles = [engine.submit("prefetch", lambda i=i: seen.append(i) or i, label=f"j{i}") for i in range(50)]
    assert [h.wait(T) for h in handles] == list(range(50))
    assert seen == list(range(50))


def test_two_channels_run_concurrently(engine):
    a_in, b_in = threading.Event(), threading.Event()

    def job(mine, other):
        mine.set()
        return other.wait(T)          # True only if the other job runs at the same time

    ha = engine.submit("prefetch", lambda: job(a_in, b_in), label="a")
    hb = engine.submit("ondemand", lambda: job(b_in, a_in), label="b")
    assert ha.wait(T) and hb.wait(T)
    ev = {e.name: e for e in engine.tracer.events()}
    assert _overlap(ev["a"], ev["b"])
    assert ev["a"].stream == "prefetch" and ev["b"].stream == "ondemand"


def test_disk_workers_read_concurrently_and_all_stop():
    """disk_workers=2: two reads are in flight at once (each waits for the other to start),
    other channels stay FIFO, and every disk thread stops on close."""
    eng = TransferEngine("cpu", tracer=Tracer(), disk_workers=2)
    a_in, b_in = threading.Event(), threading.Event()

    def job(mine, other):
        mine.set()
        return other.wait(T)

    ha = eng.submit("disk", lambda: job(a_in, b_in), label="a", tier="disk")
    hb = eng.submit("disk", lambda: job(b_in, a_in), label="b", tier="disk")
    assert ha.wait(T) and hb.wait(T)
    assert sum(t.name.startswith("kinject-work-disk") for t in eng._threads) == 2
    threads = list(eng._threads)
    eng.close()
    for t in threads:
        t.join(T)
        assert not t.is_alive()
    with pytest.raises(ValueError, match="disk_workers"):
        TransferEngine("cpu", disk_workers=0)


def test_emulated_bandwidth_lower_bound_and_shared_link():
    tr = Tracer()
    nbytes, gbps = 20_000_000, 1.0            # 20 MB at 1 GB/s: >= 20 ms each
    with TransferEngine("cpu", emulate_bandwidth=gbps, tracer=tr) as eng:
        assert eng.emulated and eng.stats["emulated"]
        hs = [eng.submit(ch, lambda: None, label=ch, nbytes=nbytes, layer=0)
              for ch in ("prefetch", "ondemand", "kv_load")]
        for h in hs:
            h.wait(T)
        evs = tr.events()
        need = nbytes / (gbps * 1e9)
        assert len(evs) == 3
        for e in evs:
            assert e.kind == "transfer" and e.args["emulated"] is True
            assert e.duration >= need * (1 - 1e-6)
            assert e.args["link_end"] - e.args["link_start"] >= need * (1 - 1e-6)
        links = sorted((e.args["link_start"], e.args["link_end"]) for e in evs)
        for (_, end0), (start1, _) in zip(links, links[1:]):
            assert start1 >= end0                # one shared host->device link: never overlapping
        assert eng.stats["emulated_s"] >= 3 * need * (1 - 1e-6)
        assert eng.stats["bytes"]["prefetch"] == nbytes


def test_emulated_link_keeps_its_own_schedule():
    """Queued transfers hold the link back to back, however late their worker wakes up: the link
    is a schedule (like a DMA engine), not one sleep per transfer, so a busy machine's late
    wake-ups do not add up into a slower link."""
    import threading

    tr = Tracer()
    n, nbytes = 40, 1_000_000                   # 1 ms each at 1 GB/s
    gate = threading.Event()
    with TransferEngine("cpu", emulate_bandwidth=1.0, tracer=tr) as eng:
        hs = [eng.submit("prefetch", gate.wait, label="t0", nbytes=nbytes)]
        hs += [eng.submit("prefetch", lambda: None, label=f"t{i}", nbytes=nbytes) for i in range(1, n)]
        gate.set()                              # every job is queued before the first one runs
        for h in hs:
            h.wait(T)
        links = [(e.args["link_start"], e.args["link_end"]) for e in sorted(tr.events(), key=lambda e: int(e.name[1:]))]
        gaps = [start1 - end0 for (_, end0), (start1, _) in zip(links, links[1:])]
        assert min(gaps) >= -1e-9                                # FIFO on one link: never overlapping
        assert sum(gaps) < 0.25 * n * nbytes / 1e9              # only each job's own fn time between them
        assert eng.stats["emulated_s"] == pytest.approx(n * nbytes / 1e9, rel=1e-6)


def test_emulated_latency_and_link_bytes():
    tr = Tracer()
    with TransferEngine("cpu", emulate_bandwidth=1.0, emulate_latency=0.01, tracer=tr) as eng:
        eng.submit("prefetch", lambda: None, label="lat", nbytes=0, link_bytes=1).wait(T)
        eng.submit("disk", lambda: None, label="disk", nbytes=10**9).wait(T)   # real I/O: no link
        ev = {e.name: e for e in tr.events()}
        assert ev["lat"].duration >= 0.01 * (1 - 1e-6)
        assert "link_start" not in ev["disk"].args and ev["lat"].args["link_start"] >= 0


def test_not_emulated_by_default(engine):
    assert not engine.emulated
    engine.submit("prefetch", lambda: None, label="x", nbytes=10**12).wait(T)   # would take 1000 s
    assert engine.stats["emulated_s"] == 0.0


def test_raising_job_then_channel_still_works(engine):
    def boom():
        raise RuntimeError("disk on fire")

    bad = engine.submit("disk", boom, label="layer3.expert5", nbytes=7)
    good = engine.submit("disk", lambda: 42, label="next", nbytes=3)
    msg = r"transfer 'layer3.expert5' on channel 'disk' failed: .*disk on fire"
    with pytest.raises(TransferError, match=msg) as ei:
        bad.wait(T)
    assert isinstance(ei.value.__cause__, RuntimeError)
    assert good.wait(T) == 42
    assert bad.done() and good.done()
    assert engine.stats["errors"]["disk"] == 1 and engine.stats["bytes"]["disk"] == 3
    fail = next(e for e in engine.tracer.events() if e.name == "layer3.expert5")
    assert "disk on fire" in fail.args["error"] and fail.nbytes == 0
    # usable again on every channel after the error
    assert engine.submit("ondemand", lambda: "ok", label="after").wait(T) == "ok"


def test_timeout_behind_a_hung_job(engine):
    release = threading.Event()
    hung = engine.submit("ondemand", lambda: release.wait(T), label="hung")
    behind = engine.submit("ondemand", lambda: "late", label="behind")
    assert not behind.done()
    with pytest.raises(TransferError, match="'behind'.*timed out"):
        behind.wait(timeout=0.05)
    with pytest.raises(TransferError, match="still running"):
        engine.synchronize(timeout=0.05)
    release.set()
    assert behind.wait(T) == "late" and hung.wait(T) is True
    engine.synchronize(timeout=T)


def test_done_callbacks_fire_exactly_once(engine):
    calls = []
    gate = threading.Event()
    ok = engine.submit("prefetch", lambda: gate.wait(T), label="ok")
    bad = engine.submit("prefetch", lambda: 1 / 0, label="bad")
    ok.add_done_callback(lambda h: calls.append(("ok", h)))
    bad.add_done_callback(lambda h: calls.append(("bad", h)))
    gate.set()
    ok.wait(T)
    engine.synchronize(timeout=T)
    ok.add_done_callback(lambda h: calls.append(("late", h)))    # already done: called right away
    assert sorted(c[0] for c in calls) == ["bad", "late", "ok"]
    assert dict((k, h) for k, h in calls)["ok"] is ok


def test_completion_order_via_callbacks(engine):
    order = []
    gate, fast_done = threading.Event(), threading.Event()
    slow = engine.submit("prefetch", lambda: gate.wait(T), label="slow")
    fast = engine.submit("ondemand", lambda: None, label="fast")
    for h in (slow, fast):
        h.add_done_callback(lambda h: order.append(h.label))
    fast.add_done_callback(lambda h: fast_done.set())
    assert fast_done.wait(T)
    gate.set()
    engine.synchronize(timeout=T)
    assert order == ["fast", "slow"]


def test_copy_to_device_on_cpu_returns_same_tensor():
    tr = Tracer()
    with TransferEngine("cpu", emulate_bandwidth=1.0, tracer=tr) as eng:
        src = torch.randn(1000, 1000)                      # 4 MB -> >= 4 ms emulated
        h = eng.copy_to_device(src, channel="prefetch", label="w", layer=2, tier="disk")
        assert h.nbytes == src.numel() * 4
        assert h.wait(T) is src
        (ev,) = tr.events()
        assert ev.duration >= h.nbytes / 1e9 * (1 - 1e-6)
        assert (ev.layer, ev.tier, ev.nbytes) == (2, "disk", h.nbytes)
        assert tr.bytes_by_tier() == {"disk": h.nbytes}
        out = torch.empty_like(src)
        assert eng.copy_to_device(src, channel="prefetch", label="w2", out=out).wait(T) is out
        assert torch.equal(out, src)
        assert eng.copy_to_host(src, label="kv").wait(T, host=True) is src
    assert eng.pin(src) is src


def test_submit_many_is_one_hand_off_and_each_job_lands_on_its_own():
    """A batch goes to the channel's worker at once, runs in order after what was queued before,
    and each job lands (result, callbacks, its own slot on the emulated link) by itself: the
    first job's callback runs before the last job's link time has even started."""
    tr = Tracer()
    n, nbytes = 5, 2_000_000                    # 2 ms each at 1 GB/s
    with TransferEngine("cpu", emulate_bandwidth=1.0, tracer=tr) as eng:
        before = eng.submit("prefetch", lambda: "before", label="before", nbytes=0)
        hand_overs, real = [], eng._hand_over
        eng._hand_over = lambda *a: hand_overs.append(a[0]) or real(*a)
        landed_at: dict[str, float] = {}
        hs = eng.submit_many("prefetch", [(lambda i=i: i, f"u{i}", nbytes, 3) for i in range(n)])
        assert hand_overs == ["prefetch"]       # one hand-off for the whole batch
        for h in hs:
            h.add_done_callback(lambda h: landed_at.setdefault(h.label, tr.now()))
        assert [h.wait(T) for h in hs] == list(range(n)) and before.wait(T) == "before"
        eng.synchronize(timeout=T)
        assert all(h.done() for h in hs) and not eng._pending
        evs = {e.name: e for e in tr.events()}
        assert evs["u0"].layer == 3 and evs["u0"].nbytes == nbytes and evs["u0"].args["emulated"]
        links = [(evs[f"u{i}"].args["link_start"], evs[f"u{i}"].args["link_end"]) for i in range(n)]
        assert all(b[0] >= a[1] - 1e-9 for a, b in zip(links, links[1:]))     # in order, one link
        assert landed_at["u0"] < links[-1][0]                                  # landed alone, not with the batch
        assert eng.stats["jobs"]["prefetch"] == n + 1 and eng.stats["bytes"]["prefetch"] == n * nbytes
        assert eng.stats["emulated_s"] == pytest.approx(n * nbytes / 1e9, rel=1e-6)


def test_submit_many_failures_inline_disk_and_close():
    # a failing job fails alone; the batch goes on
    with TransferEngine("cpu", emulate_bandwidth=100.0) as eng:
        a, bad, c = eng.submit_many("ondemand", [(lambda: 1, "a", 8, None), (lambda: 1 / 0, "bad", 8, None),
                                                 (lambda: 3, "c", 8, None)])
        assert a.wait(T) == 1 and c.wait(T) == 3
        with pytest.raises(TransferError, match="'bad'.*ZeroDivisionError"):
            bad.wait(T)
        assert eng.submit_many("ondemand", []) == []
        with pytest.raises(TransferError, match="unknown transfer channel"):
            eng.submit_many("nope", [(lambda: 1, "x", 0, None)])
    # inline engine: done when submit_many returns; disk: one job per item (parallel readers)
    with TransferEngine("cpu", inline=True, disk_workers=2) as eng:
        hs = eng.submit_many("prefetch", [(lambda i=i: i, f"i{i}", 4, None) for i in range(3)])
        assert all(h.done() for h in hs) and [h.wait(0) for h in hs] == [0, 1, 2]
        assert [h.wait(T) for h in eng.submit_many("disk", [(lambda: "r", "r", 4, None)], tier="disk")] == ["r"]
    # close cancels the jobs of a batch that did not start
    eng = TransferEngine("cpu")
    started, release = threading.Event(), threading.Event()
    running = eng.submit("prefetch", lambda: started.set() or release.wait(T), label="running")
    queued = eng.submit_many("prefetch", [(lambda: "never", f"q{i}", 0, None) for i in range(3)])
    assert started.wait(T)
    threading.Timer(0.05, release.set).start()
    eng.close()
    assert running.wait(T) is True
    for h in queued:
        with pytest.raises(TransferError, match="cancelled"):
            h.wait(T)
    eng.synchronize(timeout=T)
    with pytest.raises(TransferError, match="closed"):
        eng.submit_many("prefetch", [(lambda: 1, "late", 0, None)])


def test_timed_engine_runs_jobs_in_the_caller_and_lands_them_on_the_link_schedule():
    """An emulated link on a CPU with ``inline`` (what the runtime makes): jobs run in the
    submitting thread, no worker thread starts; a job is done once its link slot has passed
    (slots back to back, in order, one shared link); a done-callback runs on the timer at that
    time, not before; a failing job fails alone; synchronize waits for the link and callbacks."""
    tr = Tracer()
    nbytes = 60_000_000            # 60 ms each at 1 GB/s: a busy machine must not pass a slot before we look
    with TransferEngine("cpu", emulate_bandwidth=1.0, inline=True, tracer=tr) as eng:
        assert eng.timed and not eng.inline
        ran_in = []
        t0 = __import__("time").perf_counter()
        a = eng.submit("ondemand", lambda: ran_in.append(threading.current_thread()) or "a", label="a", nbytes=nbytes)
        b, bad, c = eng.submit_many("prefetch", [(lambda: "b", "b", nbytes, 1), (lambda: 1 / 0, "bad", nbytes, 1),
                                                 (lambda: "c", "c", nbytes, 1)])
        assert ran_in == [threading.current_thread()] and not eng._threads
        assert not a.done() and not c.done() and bad.done()
        fired = {}
        for h in (a, b, c):
            h.add_done_callback(lambda h: fired.setdefault(h.label, (__import__("time").perf_counter(), threading.current_thread())))
        assert c.wait(T) == "c" and c.done()
        assert __import__("time").perf_counter() - t0 >= 3 * nbytes / 1e9 * (1 - 1e-6)   # three slots, one link
        with pytest.raises(TransferError, match="'bad'.*ZeroDivisionError"):
            bad.wait(T)
        eng.synchronize(timeout=T)
        assert set(fired) == {"a", "b", "c"} and all(th is not threading.current_thread() for _, th in fired.values())
        assert fired["a"][0] < fired["b"][0] < fired["c"][0]
        evs = {e.name: e for e in tr.events()}
        links = [(evs[n].args["link_start"], evs[n].args["link_end"]) for n in "abc"]
        assert all(y[0] >= x[1] - 1e-9 for x, y in zip(links, links[1:]))
        assert all(z - s >= nbytes / 1e9 * (1 - 1e-6) for s, z in links)
        assert eng.stats["jobs"]["prefetch"] == 3 and eng.stats["errors"]["prefetch"] == 1
        assert eng.stats["emulated_s"] == pytest.approx(3 * nbytes / 1e9, rel=1e-6)
        late = eng.submit("prefetch", lambda: 1, label="late", nbytes=nbytes)
        with pytest.raises(TransferError, match="timed out"):
            late.wait(0.0001)
        assert late.wait(T) == 1 and late.landed_result() == 1
        done_now = []
        late.add_done_callback(done_now.append)             # done: runs at once, in the caller
        assert done_now == [late]
        pending = eng.submit("prefetch", lambda: 2, label="pending", nbytes=10 * nbytes)
        on_close = []
        pending.add_done_callback(on_close.append)
    assert on_close == [pending]                            # close runs what is left


def test_close_is_idempotent_and_refuses_new_work():
    eng = TransferEngine("cpu")
    eng.submit("kv_store", lambda: 1, label="x").wait(T)
    threads = list(eng._threads)
    eng.close()
    eng.close()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(TransferError, match="closed"):
        eng.submit("kv_store", lambda: 1, label="y")


def test_close_cancels_queued_jobs():
    eng = TransferEngine("cpu")
    started, release = threading.Event(), threading.Event()
    running = eng.submit("prefetch", lambda: started.set() or release.wait(T), label="running")
    queued = eng.submit("prefetch", lambda: "never", label="queued")
    assert started.wait(T)
    threading.Timer(0.05, release.set).start()
    eng.close()
    assert running.wait(T) is True
    with pytest.raises(TransferError, match="'queued'.*cancelled"):
        queued.wait(T)
    assert queued.done()
    eng.synchronize(timeout=T)          # cancelled jobs count as finished


def test_unknown_channel_and_bad_arguments(engine):
    with pytest.raises(TransferError, match="unknown transfer channel 'gpu'"):
        engine.submit("gpu", lambda: None, label="x")
    with pytest.raises(ValueError):
        TransferEngine("cpu", emulate_bandwidth=0)
    assert set(CHANNELS) == {"prefetch", "ondemand", "kv_load", "kv_store", "disk"}


def test_unreferenced_engine_stops_its_threads():
    eng = TransferEngine("cpu")
    eng.submit("prefetch", lambda: None, label="x").wait(T)
    threads = list(eng._threads)
    del eng
    gc.collect()
    for t in threads:
        t.join(T)
        assert not t.is_alive()


def test_no_tracer_and_disabled_tracer():
    with TransferEngine("cpu", emulate_bandwidth=100.0) as eng:
        assert eng.submit("prefetch", lambda: 5, label="x", nbytes=10).wait(T) == 5
    tr = Tracer(enabled=False)
    with TransferEngine("cpu", tracer=tr) as eng:
        eng.submit("prefetch", lambda: 5, label="x", nbytes=10).wait(T)
    assert tr.events() == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copy_to_device_from_pinned_memory():
    tr = Tracer(device="cuda")
    with TransferEngine("cuda", tracer=tr) as eng:
        src = eng.pin(torch.arange(1 << 20, dtype=torch.float32))
        assert src.is_pinned()
        landed = []
        h = eng.copy_to_device(src, channel="ondemand", label="expert0", layer=0)
        h.add_done_callback(lambda hh: landed.append(hh.label))
        dst = h.wait(T)                                   # current stream waits on the event
        assert dst.device.type == "cuda"
        y = dst * 2                                       # consumer work on the current stream
        assert torch.equal(y.cpu(), src * 2)
        # into a preallocated buffer, then back to pinned host memory
        out = torch.empty(1 << 20, device="cuda")
        assert eng.copy_to_device(src, channel="prefetch", label="w", out=out).wait(T) is out
        back = eng.copy_to_host(out + 1, label="kv").wait(T, host=True)
        assert back.is_pinned() and torch.equal(back, src + 1)
        # failures surface on CUDA too, and the channel keeps working
        with pytest.raises(TransferError, match="'bad'"):
            eng.submit("ondemand", lambda: 1 / 0, label="bad").wait(T)
        again = eng.copy_to_device(src, channel="ondemand", label="again").wait(T)
        assert torch.equal(again.cpu(), src)
        eng.synchronize(timeout=T)
        assert landed == ["expert0"] and h.done()
    evs = [e for e in tr.events() if e.kind == "transfer"]
    assert {e.name for e in evs} >= {"expert0", "w", "kv"}
    assert all(e.end >= e.start for e in evs)


# ---------------------------------------------------------------------------- fake CUDA
# The CUDA branches cannot run on a CPU-only machine; this stand-in for torch.cuda's
# stream/event API runs them anyway, to check the control flow (which stream waits on
# which event, when the host blocks) before the code first meets a GPU.

class _FakeEvent:
    log: list = []

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.t = None
        self.stream = None
        self.blocking = blocking

    def record(self, stream=None):
        self.stream = stream if stream is not None else _fake_current()
        self.t = __import__("time").perf_counter()
        _FakeEvent.log.append(("record", self.stream.name))

    def query(self):
        return self.t is not None

    def synchronize(self):
        assert self.t is not None, "synchronize on an event never recorded"
        _FakeEvent.log.append(("event.synchronize", self.stream.name))

    def elapsed_time(self, end):
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1000.0


class _FakeStream:
    def __init__(self, device=None, priority=0, name=None):
        self.name = name or f"side{id(self) % 1000}"

    def wait_event(self, ev):
        assert ev.t is not None, "waiting on an event never recorded"
        _FakeEvent.log.append(("wait_event", self.name, ev.stream.name))

    def synchronize(self):
        _FakeEvent.log.append(("stream.synchronize", self.name))


_tls = threading.local()
_DEFAULT = _FakeStream(name="default")


def _fake_current(device=None):
    return getattr(_tls, "stream", _DEFAULT)


class _stream_ctx:
    def __init__(self, s):
        self.s = s

    def __enter__(self):
        self.prev, _tls.stream = _fake_current(), self.s

    def __exit__(self, *exc):
        _tls.stream = self.prev


@pytest.fixture
def fake_cuda(monkeypatch):
    import contextlib

    _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", _fake_current)
    monkeypatch.setattr(torch.cuda, "stream", _stream_ctx)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: _FakeEvent.log.append(("set_device", str(d))))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("global synchronize"))
    return _FakeEvent.log


def test_fake_cuda_control_flow(fake_cuda):
    log = fake_cuda
    tr = Tracer(device="cuda")
    with TransferEngine("cuda", tracer=tr) as eng:
        assert eng.device == torch.device("cuda", 0)
        for ch in CHANNELS:
            eng._streams[ch].name = ch
        streams_before = dict(eng._streams)
        landed = threading.Event()
        h = eng.submit("ondemand", lambda: "w", label="e5", nbytes=8, layer=1)
        h.add_done_callback(lambda _h: landed.set())
        assert h.wait(T) == "w"
        # the consumer (default stream) waits on an event recorded on the ondemand stream
        assert ("wait_event", "default", "ondemand") in log
        assert landed.wait(T) and h.done()
        assert ("event.synchronize", "ondemand") in log          # landing thread, not the caller
        # each engine thread (the channel's worker, its landing thread) made the engine's GPU its own first
        assert log.count(("set_device", "cuda:0")) == 2 and log.index(("set_device", "cuda:0")) < log.index(("record", "ondemand"))
        log.clear()
        # wait_current: the channel stream first waits for the caller's stream
        eng.submit("kv_store", lambda: None, label="kv", wait_current=True).wait(T, host=True)
        assert log.index(("record", "default")) < log.index(("wait_event", "kv_store", "default"))
        assert ("event.synchronize", "kv_store") in log          # host=True blocks on that event only
        # a failing job on CUDA: error reported, channel alive
        with pytest.raises(TransferError, match="'bad'"):
            eng.submit("ondemand", lambda: 1 / 0, label="bad").wait(T)
        assert eng.submit("ondemand", lambda: 3, label="ok").wait(T) == 3
        # inside fn the channel stream is current, so a nested wait orders the two streams
        first = eng.submit("disk", lambda: "bytes", label="read", tier="disk")
        assert eng.submit("ondemand", lambda: first.wait(T), label="h2d").wait(T) == "bytes"
        assert ("wait_event", "ondemand", "disk") in log
        eng.synchronize(timeout=T)
        assert eng._streams == streams_before                   # streams created once
    evs = {e.name: e for e in tr.events()}                      # GPU-timed spans resolved lazily
    assert {"e5", "kv", "ok", "read", "h2d"} <= set(evs)
    assert evs["e5"].kind == "transfer" and evs["e5"].layer == 1 and evs["e5"].nbytes == 8
    assert evs["read"].tier == "disk" and all(e.end >= e.start for e in evs.values())


def test_fake_cuda_submit_many_lands_each_job_by_its_event(fake_cuda):
    log = fake_cuda
    with TransferEngine("cuda") as eng:
        for ch in CHANNELS:
            eng._streams[ch].name = ch
        landed = []
        hs = eng.submit_many("prefetch", [(lambda i=i: i, f"e{i}", 8, 0) for i in range(3)])
        for h in hs:
            h.add_done_callback(lambda h: landed.append(h.label))
        assert [h.wait(T) for h in hs] == [0, 1, 2]
        eng.synchronize(timeout=T)
        assert sorted(landed) == ["e0", "e1", "e2"] and all(h.done() for h in hs)
        assert log.count(("record", "prefetch")) == 3 and log.count(("event.synchronize", "prefetch")) == 3
        assert log.count(("wait_event", "default", "prefetch")) == 3


def test_fake_cuda_emulated_uses_host_timing(fake_cuda):
    tr = Tracer(device="cuda")
    with TransferEngine("cuda", tracer=tr, emulate_bandwidth=1.0) as eng:
        eng.submit("prefetch", lambda: None, label="p", nbytes=1_000_000).wait(T)
    (ev,) = tr.events()
    assert ev.args["emulated"] and ev.args["timing"] == "host (issue)"
    assert ev.duration >= 1e-3 * (1 - 1e-6)


def test_fake_cuda_tracer_spans_resolve_lazily(fake_cuda, monkeypatch):
    import kinject.trace as trace_mod

    monkeypatch.setattr(trace_mod, "_PENDING_DRAIN", 3)
    tr = Tracer(device="cuda")
    for i in range(3):
        with tr.span("compute", f"op{i}", layer=i):
            pass
    assert len(tr._pending) == 3 and not tr._events            # nothing resolved in the hot path
    with tr.span("compute", "op3"):
        pass
    assert not tr._pending and len(tr._events) == 4            # drained the finished ones (query)
    evs = tr.events()
    assert [e.name for e in evs] == ["op0", "op1", "op2", "op3"] and evs[2].layer == 2
    assert all(0.0 <= e.start <= e.end <= tr.now() for e in evs)
    tr.clear()
    assert tr.events() == [] and tr._ref_event is not None


def test_outcome_is_a_future_for_what_handles_use():
    """_Outcome (the handles' light Future): result / exception / cancel / callbacks / waits across threads."""
    import threading as _threading
    from concurrent.futures import CancelledError, InvalidStateError
    from concurrent.futures import TimeoutError as FutureTimeout

    from kinject.engine.transfer_handles import _Outcome

    seen = []
    o = _Outcome()
    o.add_done_callback(lambda f: seen.append(("early", f.result())))
    with pytest.raises(FutureTimeout):
        o.result(timeout=0.01)
    assert o.set_running_or_notify_cancel() and not o.cancel() and not o.done()
    _threading.Timer(0.05, o.set_result, args=(7,)).start()
    assert o.result(timeout=5) == 7 and o.done() and not o.cancelled()
    o.add_done_callback(lambda f: seen.append(("late", f.result())))        # done: runs right away
    assert seen == [("early", 7), ("late", 7)]
    with pytest.raises(InvalidStateError):
        o.set_result(8)

    failed = _Outcome()
    failed.add_done_callback(lambda f: 1 / 0)                               # logged, not raised
    failed.set_exception(ValueError("x"))
    assert isinstance(failed.exception(), ValueError)
    with pytest.raises(ValueError):
        failed.result()

    cancelled = _Outcome()
    assert cancelled.cancel() and cancelled.cancel() and cancelled.cancelled() and cancelled.wait(0)
    assert not cancelled.set_running_or_notify_cancel()
    with pytest.raises(CancelledError):
        cancelled.result()


def test_host_to_device_copies_small_host_tensors_from_pinned_memory(monkeypatch):
    """host_to_device: on its own device a tensor is handed back as it is; to CUDA a pageable host
    tensor goes through a pinned copy, non_blocking (a pageable one may make the driver wait for the
    stream); a pinned one is not pinned again."""
    from kinject.engine.transfer import host_to_device

    t = torch.arange(4)
    assert host_to_device(t, torch.device("cpu")) is t
    calls = []

    class Host:
        device = torch.device("cpu")

        def __init__(self, pinned):
            self.pinned = pinned

        def is_pinned(self):
            return self.pinned

        def pin_memory(self):
            calls.append("pin")
            return Host(True)

        def to(self, device, non_blocking=False):
            calls.append(("to", str(device), non_blocking, self.pinned))
            return "on device"

    cuda = torch.device("cuda", 0)
    assert host_to_device(Host(False), cuda) == "on device"
    assert calls == ["pin", ("to", "cuda:0", True, True)]
    calls.clear()
    assert host_to_device(Host(True), cuda) == "on device"
    assert calls == [("to", "cuda:0", True, True)]


def test_record_stream_reaches_every_device_tensor_of_a_nested_result():
    """CUDA: a result's device tensors are ``record_stream``-ed on the stream that waits for them (so
    the caching allocator cannot reuse their memory before that stream is done with them): every one
    in nested dicts, lists and tuples (a decode chunk's parts, a unit's tensors), none on the host."""
    from kinject.engine.transfer_handles import _record_stream

    recorded = []

    class OnDevice(torch.Tensor):              # a CPU tensor that answers as a CUDA one
        @property
        def is_cuda(self):
            return True

        def record_stream(self, stream):
            recorded.append((self, stream))

    a, b, host = torch.zeros(2).as_subclass(OnDevice), torch.ones(3).as_subclass(OnDevice), torch.zeros(1)
    _record_stream({"parts": [a, (b, host)], "none": None}, "stream")
    assert [(id(t), s) for t, s in recorded] == [(id(a), "stream"), (id(b), "stream")]
