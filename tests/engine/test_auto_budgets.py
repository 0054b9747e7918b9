"""``pipeline.host_budget: auto`` / ``device_budget: auto`` (kinject/engine/memory.py): what they choose,
the host cache shrinking when MemAvailable drops, and bad values refused where they are written."""

import io

import pytest
import torch

import kinject
from kinject.engine import memory
from kinject.engine.memory import MemoryWatch, auto_device_budget, auto_host_budget, safety_margin
from kinject.engine.store import TensorStore
from kinject.engine.transfer import TransferEngine
from kinject.errors import RuleError
from kinject.rules import load_rules
from kinject.testing import save_tiny_model, tiny_batch

UNIT = 64 * 4
GiB = 2**30


class FakeMemory:
    """A MemAvailable reader the test sets (the machine's memory "drops" when it says so)."""

    def __init__(self, available: int):
        self.available = available
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        return self.available


def test_auto_host_budget_is_mem_available_less_the_margin():
    fake = FakeMemory(10 * GiB)
    choice, watch = auto_host_budget(reader=fake, total=24 * GiB)
    margin = safety_margin(24 * GiB)
    assert margin == int(2.4 * GiB) and choice.value == 10 * GiB - margin
    assert "MemAvailable 10.00 GiB" in choice.line() and "host_budget: auto" in choice.line()
    assert watch.margin == margin
    assert safety_margin(2 * GiB) == 512 << 20 and safety_margin(512 * GiB) == 4 << 30
    none, watch = auto_host_budget(reader=lambda: None)
    assert none.value is None and watch is None and "unknown" in none.why


@pytest.mark.parametrize("free,kv", [(40 * GiB, None), (8 * GiB, 2 * GiB), (512 << 20, None)])
def test_auto_device_budget_cuda_leaves_the_kv_and_an_activation_reserve(free, kv):
    choice = auto_device_budget("cuda:0", kv, free_memory=lambda: (free, 80 * GiB))
    reserve = max(memory.DEVICE_RESERVE_MIN, int(free * memory.DEVICE_RESERVE_SHARE))
    assert choice.value == max(0, free - (kv or 0) - reserve)
    assert "free device memory" in choice.why
    cpu = auto_device_budget("cpu")
    assert cpu.value is None and "same memory" not in cpu.why and "host memory" in cpu.why


def _disk_store(tmp_path, watch, host_budget, n=6):
    store = TensorStore("cpu", TransferEngine("cpu", inline=True), offload_dir=tmp_path, host_budget=host_budget,
                        memory_watch=watch)
    units = [store.add(f"e{i}", {"w": torch.full((64,), float(i))}, "disk", owner="experts") for i in range(n)]
    return store, units


def _use(store, units):
    store.fetch_many(units)
    got = store.acquire_many(units)
    store.release_many(units)
    return got


def test_host_cache_shrinks_when_mem_available_drops_and_never_grows_past_what_is_spare(tmp_path):
    fake = FakeMemory(100 * UNIT)
    watch = MemoryWatch(margin=10 * UNIT, reader=fake, interval=0.0)
    store, units = _disk_store(tmp_path, watch, host_budget=50 * UNIT)
    _use(store, units)
    assert store.host_cached == 6 * UNIT                  # plenty spare: every unit read once is kept
    fake.available = 10 * UNIT + 2 * UNIT                 # another process took memory: 2 units spare
    # (what the cache holds is already out of MemAvailable; spare 2 -> capacity = held + 2)
    assert store.host_cache_capacity == 8 * UNIT
    fake.available = 10 * UNIT - 4 * UNIT                 # 4 units under the margin: give 4 back
    assert store.fit_host_cache() == 4 * UNIT
    assert store.host_cached == 2 * UNIT and store.stats["host_cache"]["shrunk_bytes"] == 4 * UNIT
    held = [u.name for u in units if u.host_cache is not None]
    assert held == ["e4", "e5"]                            # least recently used went first
    fake.available = 10 * UNIT                            # at the margin: nothing more is cached
    _use(store, units[:3])
    assert store.host_cached == 2 * UNIT
    got = _use(store, units)                               # still right: read from disk where not cached
    assert all(torch.equal(g["w"], torch.full((64,), float(i))) for i, g in enumerate(got))
    fake.available = 100 * UNIT                           # memory came back: the cache may grow again
    _use(store, units)
    assert store.host_cached == 6 * UNIT


def test_an_entry_in_use_is_not_given_back_until_released(tmp_path):
    fake = FakeMemory(100 * UNIT)
    store, units = _disk_store(tmp_path, MemoryWatch(margin=2 * UNIT, reader=fake, interval=0.0), 50 * UNIT, n=2)
    _use(store, units)
    held = store.acquire(units[0])
    fake.available = 0
    assert store.fit_host_cache() == UNIT and units[0].host_cache is not None
    store.release(units[0])
    assert store.fit_host_cache() == UNIT and store.host_cached == 0
    assert torch.equal(held["w"], torch.zeros(64))


def test_memory_watch_reads_meminfo_at_most_once_per_interval():
    fake, now = FakeMemory(GiB), [0.0]
    watch = MemoryWatch(margin=0, reader=fake, interval=0.5, clock=lambda: now[0])
    for _ in range(5):
        watch.spare()
    now[0] = 0.6
    watch.spare()
    assert fake.reads == 2


def test_meminfo_parser_reads_this_machine():
    info = memory.read_meminfo()
    if info is None:
        pytest.skip("no /proc/meminfo")
    assert 0 < memory.mem_available() <= memory.mem_total()


@pytest.mark.parametrize("key", ["host_budget", "device_budget"])
def test_bad_budget_is_refused_with_file_line_and_key(tmp_path, key):
    path = tmp_path / "r.yaml"
    path.write_text(f"pipeline:\n  device: cpu\n  {key}: lots\nrules:\n  - match: {{name: experts}}\n"
                    "    replace: {class: default}\n")
    with pytest.raises(RuleError) as ei:
        load_rules(path)
    assert ei.value.line == 3 and f"{path}:3" in str(ei.value) and f"pipeline.{key}" in str(ei.value)
    assert "'auto'" in str(ei.value)
    with pytest.raises(RuleError, match=f"pipeline.{key}"):
        load_rules("rules/klotski.yaml", [f"pipeline.{key}=lots"])
    assert getattr(load_rules("rules/klotski.yaml").pipeline, key) == "auto"
    assert getattr(load_rules("rules/klotski.yaml", [f"pipeline.{key}=null"]).pipeline, key) is None


def test_default_rules_cache_a_checkpoint_that_fits_read_once_in_place_tokens_as_transformers(
        tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from kinject.testing import tiny_tokenizer

    fake = FakeMemory(16 * GiB)
    monkeypatch.setattr(memory, "mem_available", fake)
    monkeypatch.setattr(memory, "mem_total", lambda: 24 * GiB)
    path = save_tiny_model("mixtral", tmp_path / "ckpt")
    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 3)
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    want = ref.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    model = kinject.from_pretrained(path, "rules/klotski.yaml",
                                    ["vars.experts=disk", f"pipeline.offload_dir={tmp_path / 'off'}"])
    rt = model.kinject
    assert rt.pipeline.host_budget == 16 * GiB - safety_margin(24 * GiB) and rt.pipeline.device_budget is None
    gen = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(gen, want)
    st = rt.store.summary()
    expert_bytes = st["tier_bytes"]["disk"]
    assert 0 < st["host_cache"]["disk_bytes"] <= expert_bytes          # each expert read from disk at most once
    assert st["copied_bytes"] == 0                                      # CPU: cache hits used in place
    rt.store.reset_stats()
    assert torch.equal(model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id), want)
    st = rt.store.summary()
    assert st["host_cache"]["disk_bytes"] == 0 and st["host_cache"]["hits"] > 0 and st["copied_bytes"] == 0
    text = rt.report(file=io.StringIO())
    assert "pipeline.host_budget: auto ->" in text and "pipeline.device_budget: auto -> unbounded" in text
    rt.store.host_cache.watch.interval = 0.0                                # (re-read at every ask, not every 0.2 s)
    fake.available = 0                                                  # memory gone: the next step gives it back
    model.generate(**batch, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    assert rt.store.host_cached == 0 and rt.store.summary()["host_cache"]["shrunk_bytes"] > 0
    rt.transfer.close()
