"""Tracer: recording, Chrome export, bubble statistics, bytes per tier."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from kinject.trace import TraceEvent, Tracer


def test_span_and_record():
    tr = Tracer()
    with tr.span("compute", "attn L0 mb0", layer=0):
        pass
    tr.record("prefetch", "model.layers.1.mlp.experts[3]", 0.5, 0.75, kind="transfer",
              layer=1, nbytes=100, tier="host")
    evs = tr.events()
    assert {e.name for e in evs} == {"attn L0 mb0", "model.layers.1.mlp.experts[3]"}
    span = next(e for e in evs if e.stream == "compute")
    assert span.kind == "compute" and span.layer == 0
    assert 0.0 <= span.start <= span.end <= tr.now()
    xfer = next(e for e in evs if e.stream == "prefetch")
    assert (xfer.start, xfer.end, xfer.nbytes, xfer.tier) == (0.5, 0.75, 100, "host")


def test_span_records_even_when_block_raises():
    tr = Tracer()
    with pytest.raises(ValueError):
        with tr.span("compute", "boom"):
            raise ValueError("x")
    assert [e.name for e in tr.events()] == ["boom"]


def test_events_sorted_by_start():
    tr = Tracer()
    for s in (3.0, 1.0, 2.0):
        tr.record("compute", f"e{s}", s, s + 0.5)
    assert [e.start for e in tr.events()] == [1.0, 2.0, 3.0]


def test_record_is_thread_safe():
    tr = Tracer()

    def work(i):
        for j in range(200):
            tr.record("compute", f"t{i}.{j}", j, j + 1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tr.events()) == 800


def test_record_rejects_unknown_fields():
    with pytest.raises(TypeError):
        Tracer().record("compute", "x", 0, 1, layr=3)


def test_to_chrome(tmp_path):
    tr = Tracer()
    tr.record("compute", "attn L0", 0.001, 0.003, layer=0)
    tr.record("compute", "experts L0", 0.003, 0.004, layer=0)
    tr.record("ondemand", "experts[5]", 0.002, 0.0025, kind="transfer", layer=0, nbytes=4096, tier="disk",
              args={"emulated": True})
    path = tmp_path / "sub" / "trace.json"
    tr.to_chrome(path)
    data = json.loads(path.read_text())
    evs = data["traceEvents"]
    names = [e for e in evs if e["ph"] == "M" and e["name"] == "thread_name"]
    assert sorted(e["args"]["name"] for e in names) == ["compute", "ondemand"]
    assert len({e["tid"] for e in names}) == 2
    tid = {e["args"]["name"]: e["tid"] for e in names}
    xs = [e for e in evs if e["ph"] == "X"]
    assert len(xs) == 3
    x = next(e for e in xs if e["name"] == "experts[5]")
    assert x["tid"] == tid["ondemand"] and x["cat"] == "transfer"
    assert x["ts"] == pytest.approx(2000.0) and x["dur"] == pytest.approx(500.0)   # microseconds
    assert x["args"] == {"layer": 0, "nbytes": 4096, "tier": "disk", "emulated": True}
    a = next(e for e in xs if e["name"] == "attn L0")
    assert a["tid"] == tid["compute"] and a["dur"] == pytest.approx(2000.0)


def test_bubble_fraction_hand_made():
    tr = Tracer()
    tr.record("compute", "a", 0.0, 1.0)
    tr.record("compute", "b", 2.0, 3.0)
    tr.record("prefetch", "w", 0.0, 3.0, kind="transfer")       # other streams do not count
    assert tr.bubble_fraction() == pytest.approx(1 / 3)
    assert tr.bubble_fraction("prefetch") == pytest.approx(0.0)
    assert tr.bubble_fraction(window=(0.0, 4.0)) == pytest.approx(0.5)
    assert tr.bubble_fraction(window=(0.5, 2.5)) == pytest.approx(0.5)
    assert tr.bubble_fraction("kv_load") == 0.0                   # no events, no window
    assert tr.bubble_fraction("kv_load", window=(0.0, 1.0)) == 1.0


def test_bubble_fraction_merges_overlaps():
    tr = Tracer()
    tr.record("compute", "a", 0.0, 2.0)
    tr.record("compute", "b", 1.0, 3.0)        # overlaps a
    tr.record("compute", "c", 1.5, 2.5)        # nested
    tr.record("compute", "d", 4.0, 5.0)
    assert tr.bubble_fraction() == pytest.approx(1 / 5)
    assert tr.summary()["busy_s"]["compute"] == pytest.approx(4.0)


def test_bytes_by_tier_and_stream():
    tr = Tracer()
    tr.record("prefetch", "a", 0, 1, kind="transfer", nbytes=10, tier="host")
    tr.record("ondemand", "b", 0, 1, kind="transfer", nbytes=20, tier="disk")
    tr.record("ondemand", "c", 1, 2, kind="transfer", nbytes=5, tier="host")
    tr.record("compute", "x", 0, 1, nbytes=999)             # compute bytes are not transfers
    assert tr.bytes_by_tier() == {"host": 15, "disk": 20}
    assert tr.bytes_by_stream() == {"prefetch": 10, "ondemand": 25}


def test_summary():
    tr = Tracer()
    tr.record("compute", "a", 0.0, 1.0)
    tr.record("compute", "b", 2.0, 3.0)
    tr.record("prefetch", "w", 0.5, 2.5, kind="transfer", nbytes=8, tier="host")
    s = tr.summary()
    assert s["busy_s"] == pytest.approx({"compute": 2.0, "prefetch": 2.0})
    assert list(s["busy_s"]) == ["compute", "prefetch"]
    assert s["bubble_fraction"] == pytest.approx(1 / 3)
    assert s["bytes_by_tier"] == {"host": 8} and s["bytes_by_stream"] == {"prefetch": 8}
    assert s["event_counts"] == {"compute": 2, "prefetch": 1}
    assert s["wall_s"] == pytest.approx(3.0)


def test_clear_restarts():
    tr = Tracer()
    tr.record("compute", "a", 0, 1)
    tr.clear()
    assert tr.events() == [] and tr.now() < 1.0
    assert tr.summary()["event_counts"] == {}


def test_disabled_tracer_records_nothing(tmp_path):
    tr = Tracer(enabled=False)
    with tr.span("compute", "x"):
        pass
    tr.record("compute", "y", 0, 1)
    assert tr.events() == []
    assert tr.summary()["busy_s"] == {} and tr.bubble_fraction() == 0.0
    tr.to_chrome(tmp_path / "t.json")
    assert [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"] == []


def test_plot_png(tmp_path):
    tr = Tracer()
    tr.record("compute", "a", 0.0, 0.001)
    tr.record("ondemand", "b", 0.0, 0.002, kind="transfer", nbytes=1, tier="host")
    tr.plot(tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_trace_event_duration():
    assert TraceEvent("compute", "x", 1.0, 1.5).duration == pytest.approx(0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_span_is_lazy_and_aligned():
    tr = Tracer(device="cuda")
    a = torch.randn(2048, 2048, device="cuda")
    h0 = tr.now()
    with tr.span("compute", "matmul"):
        for _ in range(10):
            a = a @ a / 2048
    h1 = tr.now()
    assert tr._pending and not tr._events          # not resolved in the hot path
    (ev,) = tr.events()
    assert ev.end > ev.start >= h0 - 1e-3           # aligned with the host clock (ms slack)
    torch.cuda.synchronize()
    assert ev.end <= tr.now() + 1e-3
    assert h1 >= h0


def test_plot_zooms_on_one_decode_step(tmp_path):
    tr = Tracer()
    for step, (a, b) in enumerate([(0.0, 0.010), (0.010, 0.014), (0.014, 0.019), (0.019, 0.023)]):
        tr.mark_step(a, b)
        for layer in range(2):
            mid = a + (b - a) * (layer + 1) / 3
            tr.record("compute", f"s{step} L{layer}", mid - 0.0005, mid, layer=layer)
            tr.record("prefetch", f"load L{layer}", mid - 0.001, mid - 0.0005, kind="transfer", nbytes=1, tier="host",
                      layer=layer)
    assert tr.plot(tmp_path / "p.png", title="t") is True
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    from kinject.trace import _gaps, _zoom_step

    assert _zoom_step(tr.steps()) in tr.steps()[1:]                   # a decode step, not the prefill
    assert _gaps([(0.1, 0.2), (0.15, 0.3)], (0.0, 0.5)) == [(0.0, 0.1), (0.3, 0.5)]


def test_plot_without_matplotlib_is_one_logged_line_not_a_traceback(tmp_path, monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)             # import matplotlib -> ImportError
    tr = Tracer()
    tr.record("compute", "a", 0.0, 0.001)
    assert tr.plot(tmp_path / "p.png") is False
    assert not (tmp_path / "p.png").exists()
    assert [r.getMessage() for r in caplog.records if "no plot drawn" in r.getMessage()]
