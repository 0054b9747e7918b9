"""``kinject bench offload`` end to end on a tiny model: every contender row, same tokens (no timing asserts)."""

import re

import pytest
import torch

from kinject.bench.common import same_prefix
from kinject.bench.contenders import experts_on_disk_map
from kinject.bench.offload import CONTENDERS, EXTRA_CONTENDERS, ModelShape, Workload, table
from kinject.app.cli import main
from kinject.testing import tiny_config

STABLE = [c for c in CONTENDERS if c != "kj-klotski"]   # kj-klotski depends on another operator's progress
TINY = ["--layers", "2", "--hidden", "64", "--intermediate", "32", "--heads", "4", "--kv-heads", "2",
        "--vocab", "512", "--prompt-len", "8", "--batch", "2", "--new-tokens", "3", "--repeats", "1",
        "--warmup-tokens", "1"]


def _rows(md: str) -> dict[str, list[str]]:
    rows = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in CONTENDERS + EXTRA_CONTENDERS:
            rows.setdefault(cells[0], cells)      # first table only (the timeline table comes after)
    return rows


def test_bench_offload_tiny_every_contender_same_tokens(tmp_path, capsys):
    out = tmp_path / "bench.md"
    rc = main(["bench", "offload", "-q", "--workdir", str(tmp_path / "work"), "--out", str(out),
               "--contenders", ",".join(STABLE), *TINY])
    assert rc == 0
    md = out.read_text()
    assert md.strip() in capsys.readouterr().out
    rows = _rows(md)
    assert sorted(rows) == sorted(STABLE)
    for name, cells in rows.items():
        assert cells[-1] == "✓", (name, cells)
        assert float(cells[2]) > 0, name                                   # tok/s
    assert float(rows["kj-offload"][9]) > 0                                 # kinject accounted disk bytes
    assert all(float(cells[13]) >= 0 for cells in rows.values()) and float(rows["hf-ram"][13]) > 0   # peak device GB
    for key in ("machine:", "date:", "command:", "commit:", "page cache (drop-after-read)"):
        assert key in md
    # the workdir is reused: the checkpoint is not written twice
    assert len(list((tmp_path / "work").glob("mixtral-*/kinject_bench.json"))) == 1


def test_bench_hqq4_row_reads_fewer_bytes_from_its_own_cache_files(tmp_path, monkeypatch):
    """The lossy 4-bit row reads packed experts from its HQQ cache in the workdir; the bench drops
    those files too (same page-cache handling as every other contender) and says how far the
    tokens follow hf-ram instead of a ✓."""
    import kinject.bench.contenders as contenders
    import kinject.bench.offload as bench

    dropped: set[str] = set()
    real_drop = bench.drop_page_cache
    for module in (bench, contenders):
        monkeypatch.setattr(module, "drop_page_cache", lambda files: (dropped.update(map(str, files)), real_drop(files)))
    out = tmp_path / "bench.md"
    rc = main(["bench", "offload", "-q", "--workdir", str(tmp_path / "work"), "--out", str(out),
               "--contenders", "hf-ram,kj-klotski-experts,kj-klotski-experts-hqq4", *TINY])
    assert rc == 0
    rows = _rows(out.read_text())
    full, packed = rows["kj-klotski-experts"], rows["kj-klotski-experts-hqq4"]
    assert float(packed[9]) < 0.5 * float(full[9])                          # accounted MB/token: ~0.28x
    caches = list((tmp_path / "work").glob("mixtral-*-kinject-offload/*.hqq.safetensors"))
    assert len(caches) == 2 * 8                                             # one per expert of the 2 layers
    assert {str(f) for f in caches} <= dropped
    assert packed[-1] == "✓" or packed[-1].startswith("✗ (first ")


def test_same_prefix_is_the_share_before_the_first_difference():
    ref = torch.tensor([[9, 9, 1, 2, 3, 4], [9, 9, 5, 6, 7, 8]])
    out = torch.tensor([[9, 9, 1, 2, 0, 4], [9, 9, 5, 6, 7, 8]])
    assert same_prefix(out, ref, prompt_len=2) == (2 / 4 + 4 / 4) / 2
    assert same_prefix(ref, ref, prompt_len=2) == 1.0


def test_bench_unknown_contender_is_a_one_line_error(tmp_path, capsys):
    assert main(["bench", "offload", "--contenders", "hf-ram,nope", "--workdir", str(tmp_path)]) == 2
    assert "unknown contender 'nope'" in capsys.readouterr().err


def test_experts_on_disk_map_covers_every_module_once():
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(tiny_config("mixtral", num_hidden_layers=2))
    dm = experts_on_disk_map(model)
    assert [k for k, v in dm.items() if v == "disk"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert "lm_head" in dm and "model.layers.0.self_attn" in dm and "model.layers.0.mlp.gate" in dm
    for name, _ in model.named_parameters():                     # every parameter placed exactly once
        assert sum(name == k or name.startswith(k + ".") for k in dm) == 1, name


def test_table_shows_a_failed_contender_as_a_row():
    from kinject.bench.contenders import Contender

    ok = Contender("hf-ram", "all in RAM", None, [], accounted=lambda: 0, times=[1.0], read_bytes=[0],
                   accounted_bytes=[0])
    bad = Contender("kj-klotski", "-", None, [], accounted=lambda: 0, error="load failed: RuleError: boom")
    md = table({"contenders": [ok, bad], "baseline": 0, "bandwidth": 1e9, "reference": True}, Workload())
    rows = _rows(md)
    assert rows["hf-ram"][-1] == "✓"
    assert "load failed: RuleError: boom" in rows["kj-klotski"][2]
    assert ModelShape().describe().startswith("Mixtral-shaped")


WIDE_TINY = ["--wide", "--layers", "2", "--hidden", "64", "--intermediate", "32", "--experts", "16", "--top-k", "4",
             "--heads", "4", "--kv-heads", "2", "--vocab", "512", "--prompt-len", "8", "--batch", "4",
             "--new-tokens", "2", "--repeats", "1", "--warmup-tokens", "1"]


def test_wide_shape_is_qwen3_30b_a3b_cut_to_4_layers():
    """``--wide``'s preset builds the shape the issue names: 128 experts of 9.4 MB, 4.83 GB of experts
    (counted on transformers' own model built from the preset's config, on meta)."""
    from transformers import AutoModelForCausalLM

    from kinject.bench.offload import WIDE

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(WIDE.family, **WIDE.config()))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * 2      # bf16
    assert experts == WIDE.expert_bytes() == 4 * 128 * 3 * 2048 * 768 * 2
    assert model.config.num_experts_per_tok == 8 and model.config.hidden_size == 2048
    assert WIDE.describe().startswith("Qwen3-MoE-shaped random model: 4 layers")


def test_bench_wide_small_reads_experts_from_disk_every_run_same_tokens(tmp_path):
    """The ``--wide`` path at a small width: a Qwen3-MoE checkpoint in the per-expert layout, kinject's
    host cache a quarter of the experts, so every run (the page cache dropped after every forward)
    misses in it and reads experts from disk; every contender gives hf-ram's tokens."""
    from safetensors import safe_open

    out = tmp_path / "bench.md"
    assert main(["bench", "offload", "-q", "--workdir", str(tmp_path / "work"), "--out", str(out), *WIDE_TINY]) == 0
    md = out.read_text()
    rows = _rows(md)
    assert sorted(rows) == sorted(["hf-ram", "acc-devmap", "acc-maxmem", "kj-defaults", "kj-klotski-experts"])
    assert all(cells[-1] == "✓" for cells in rows.values()), rows
    assert all(float(rows[n][2]) > 0 for n in rows)                                      # tok/s
    (ckpt,) = (tmp_path / "work").glob("qwen3_moe-*/model.safetensors")
    with safe_open(ckpt, "pt") as f:
        assert "model.layers.1.mlp.experts.15.down_proj.weight" in set(f.keys())     # per-expert layout
    experts = 2 * 16 * 3 * 64 * 32 * 2
    assert f"pipeline.host_budget {experts // 4 / 1e9:.3g} GB = 25% of the experts'" in md
    cache = [ln for ln in md.splitlines() if ln.startswith("| kj-klotski-experts |") and "GB" not in ln][-1]
    capacity, hits, misses, _, _, disk, _ = (float(c.strip().rstrip("%")) for c in cache.strip("|").split("|")[1:8])
    assert capacity == float(f"{experts // 4 / 1e9:.3g}")
    assert misses > 0 and disk > 0                      # below the experts' size: experts come from disk
    assert float(rows["kj-klotski-experts"][8]) > 0      # and /proc/self/io saw the reads
    # accounted disk bytes: the units read from disk, not the loads the host cache served
    assert float(rows["kj-klotski-experts"][9]) == pytest.approx(disk * 1e3, rel=1e-2)
    # equal memory: acc-maxmem gets the kinject rows' device_budget + host_budget as max_memory, and
    # keeps no more than that in RAM; every row prints its peak device bytes
    ram = float(re.search(r"acc-maxmem: max_memory ([\d.e+-]+) GB", md).group(1))
    assert 0 < float(rows["acc-maxmem"][13]) <= ram and f"max_memory {ram:.3g} GB" in rows["acc-maxmem"][1]
    assert float(rows["kj-klotski-experts"][13]) <= ram
    # the defaults row: budgets auto (a checkpoint that fits: read from disk at most once, nothing copied)
    assert "(auto)" in rows["kj-defaults"][1]
    copied, read = (float(x.split()[0]) for x in rows["kj-defaults"][10].split("/"))
    assert copied == 0
    assert hits + misses >= 2 * 2 * 4                   # >= top-4 experts x 2 layers x 2 forwards
    routed = float(re.search(r"routed experts: ([\d.e+-]+) MB/generated token", md).group(1))
    assert 2 * 2 * 4 * (experts / 32) / 8 / 1e6 <= routed <= 2 * 2 * 16 * (experts / 32) / 8 / 1e6
    # --wide times a cold prefill alone per contender, against the disk bound of the bytes it read
    prefill = {ln.split("|")[1].strip(): [c.strip() for c in ln.strip("|").split("|")[1:]]
               for ln in md.split("| contender | cold prefill s")[1].split("\n\n")[0].splitlines()[2:]}
    assert sorted(prefill) == sorted(rows)
    assert all(float(p[0].split()[0]) > 0 for p in prefill.values())
    assert prefill["hf-ram"][2:] == ["-", "-", "-", "-"]                                    # the compute floor
    kj = prefill["kj-klotski-experts"]
    assert float(kj[1]) > 0 and kj[3].endswith("%") and kj[4].endswith("%")
    assert float(kj[4].rstrip("%")) >= float(kj[3].rstrip("%"))            # by the best repeat: never below the median's


def test_disk_bandwidth_readers_share_every_request_once(tmp_path, monkeypatch):
    """The disk bound reads every byte of the files once per reader count and round, whether one
    reader reads them in order or two share the 64 MiB requests."""
    import os

    import kinject.bench.offload as bench

    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    files[0].write_bytes(os.urandom((64 << 20) + 4097))
    files[1].write_bytes(os.urandom(12345))
    read, real = [], os.preadv

    def counted(fd, views, offset):
        n = real(fd, views, offset)
        read.append(n)
        return n

    monkeypatch.setattr(bench.os, "preadv", counted)
    for readers in ((1,), (2,), (1, 2)):
        read.clear()
        assert bench.disk_bandwidth(files, rounds=1, readers=readers) > 0
        assert sum(read) == len(readers) * sum(f.stat().st_size for f in files)


def test_bench_wide_options_override_the_preset(tmp_path, capsys):
    """``--wide`` is the shape and workload of the issue; the page cache and the host budget may be
    changed (the cold, warm and host-tier rows at the same width); a budget of 0 is refused before
    anything is written."""
    from kinject.app.cli import build_parser
    from kinject.bench.offload import WIDE, WIDE_DEVICE_BUDGET, shape_and_workload

    parser = build_parser()
    shape, work = shape_and_workload(parser.parse_args(["bench", "offload", "--wide"]))
    assert (shape, work.batch, work.prompt_len, work.page_cache, work.host_budget, work.device_budget) == \
        (WIDE, 8, 32, "drop-after-read", 0.25, WIDE_DEVICE_BUDGET)
    assert 0.41 < WIDE_DEVICE_BUDGET < 0.43                     # a 24 GiB card's share of the real 61 GB model
    _, work = shape_and_workload(parser.parse_args(["bench", "offload", "--wide", "--page-cache", "warm",
                                                    "--host-budget", "1"]))
    assert (work.page_cache, work.host_budget, work.batch) == ("warm", 1.0, 8)
    assert work.prefill and not shape_and_workload(parser.parse_args(["bench", "offload", "--wide", "--no-prefill"]))[1].prefill
    assert not shape_and_workload(parser.parse_args(["bench", "offload"]))[1].prefill
    assert main(["bench", "offload", "--workdir", str(tmp_path), *WIDE_TINY, "--host-budget", "0"]) == 2
    assert "--host-budget 0.0 must be a share of the experts' bytes > 0" in capsys.readouterr().err
    assert main(["bench", "offload", "--workdir", str(tmp_path), *WIDE_TINY, "--device-budget", "-1"]) == 2
    assert "--device-budget -1.0 must be a share of the model's bytes > 0" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []                       # refused before anything was written


def test_variant_row_names_where_its_overrides_put_the_weights(tmp_path):
    """A ``kj-…@vars.experts=host`` row's weights column comes from the loaded operators' tiers (it
    said "experts on disk", its base contender's words), with the budgets the model really got."""
    from kinject.bench.offload import load_kinject, prepare_checkpoint

    shape = ModelShape(family="qwen3_moe", layers=2, hidden=64, intermediate=32, experts=8, top_k=2, heads=4,
                       kv_heads=2, vocab=512)
    ckpt = prepare_checkpoint(shape, tmp_path)
    c = load_kinject("kj-klotski-experts@vars.experts=host", ckpt, torch.bfloat16, "sdpa", workdir=tmp_path,
                     policy="warm", host_budget=1000, device_budget=10**6)
    assert c.what.startswith("attention device, experts host, routers device, rest in RAM "
                             "(kj-klotski-experts@vars.experts=host)"), c.what
    assert c.what.endswith("; host_budget 1e-06 GB; device_budget 0.001 GB"), c.what
    c.close()
