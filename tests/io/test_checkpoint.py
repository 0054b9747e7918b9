"""kinject.io.checkpoint (and the engine's disk_sources / safetensors_header it reads with): headers-only checkpoint
index, per-expert lazy reads, both checkpoint layouts."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import kinject
from kinject.engine.disk_sources import Source, read_sources
from kinject.engine.safetensors_header import Piece
from kinject.io.checkpoint import CheckpointIndex
from kinject.errors import LoadError
from kinject.testing import FAMILIES, LEGACY_LAYOUT_FAMILIES, build_tiny_model, save_tiny_model, tiny_config

GATE_UP = "model.layers.{}.mlp.experts.gate_up_proj"

LAYOUTS = [(f, "fused") for f in FAMILIES] + [(f, "legacy") for f in sorted(LEGACY_LAYOUT_FAMILIES)] + [
    ("mixtral", "sharded-fused"),
    ("mixtral", "sharded-legacy"),
    ("qwen2_moe", "sharded-legacy"),
]


def meta_model(family: str, **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(family, **overrides))


def save(family: str, path, layout: str = "fused", **kwargs):
    sharded = layout.startswith("sharded-")
    return save_tiny_model(family, path, legacy_expert_keys=layout.endswith("legacy"),
                           max_shard_size="64KB" if sharded else None, **kwargs)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One saved checkpoint per (family, layout), built lazily and shared by the module's tests."""
    cache: dict = {}

    def get(family: str, layout: str):
        if (family, layout) not in cache:
            cache[family, layout] = save(family, tmp_path_factory.mktemp(f"{family}-{layout}"), layout)
        return cache[family, layout]

    return get


def mixtral_file(tmp_path, layout="legacy"):
    """A fresh single-file Mixtral checkpoint (tests below edit it) and its tensors."""
    path = save("mixtral", tmp_path / "ckpt", layout)
    return path, path / "model.safetensors", load_file(str(path / "model.safetensors"))


# ------------------------------------------------------------------------------------------
# round trips
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,layout", LAYOUTS, ids=[f"{f}-{l}" for f, l in LAYOUTS])
def test_round_trip(checkpoints, family, layout):
    path = checkpoints(family, layout)
    reference = build_tiny_model(family).state_dict()
    index = CheckpointIndex.open(path, meta_model(family))

    assert sorted(index.names) == sorted(reference)
    if layout.startswith("sharded"):
        assert len(index.files) > 1
    fused = [n for n in index.names if index.is_fused_expert(n)]
    assert fused and all(".mlp.experts." in n for n in fused)
    assert {n.rsplit(".", 1)[1] for n in fused} >= {"gate_up_proj", "down_proj"}
    assert not any(index.is_fused_expert(n) for n in index.names if n.endswith(("gate.weight", "router.weight")))

    for name in index.names:
        src = index.source(name)
        want = reference[name]
        assert src.name == name and src.expert is None and src.shape == tuple(want.shape)
        assert src.nbytes == want.numel() * want.element_size()
        assert torch.equal(src.read(), want), name

    for name in fused:
        want = reference[name]
        buffer = torch.empty(want.shape[1:])  # one reusable staging buffer for all experts
        for e in range(index.num_experts(name)):
            src = index.expert_source(name, e)
            assert src.expert == e and src.shape == tuple(want.shape[1:])
            assert src.nbytes == want[e].numel() * want.element_size()  # exactly one expert's bytes
            assert sum(p.nbytes for p in src.pieces) == src.nbytes
            if layout.endswith("legacy"):
                assert all(p.index is None and f".experts.{e}." in p.key for p in src.pieces)
            else:
                assert [p.index for p in src.pieces] == [(e,)] and src.pieces[0].key == name
            assert torch.equal(src.read(), want[e]), (name, e)
            assert src.read(out=buffer) is buffer and torch.equal(buffer, want[e])


def test_legacy_keys_read_per_expert(checkpoints):
    """Mixtral hub layout: gate_up of expert e = cat(w1, w3) of expert e, down = w2."""
    index = CheckpointIndex.open(checkpoints("mixtral", "legacy"), meta_model("mixtral"))
    src = index.expert_source(GATE_UP.format(1), 5)
    assert [p.key for p in src.pieces] == [
        "model.layers.1.block_sparse_moe.experts.5.w1.weight",
        "model.layers.1.block_sparse_moe.experts.5.w3.weight",
    ]
    assert src.concat_dim == 0
    down = index.expert_source("model.layers.1.mlp.experts.down_proj", 5)
    assert [p.key for p in down.pieces] == ["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
    whole = index.source(GATE_UP.format(1))
    assert len(whole.parts) == 8 and len(whole.pieces) == 16 and whole.concat_dim is None
    router = index.source("model.layers.1.mlp.gate.weight")
    assert [p.key for p in router.pieces] == ["model.layers.1.block_sparse_moe.gate.weight"]


def test_gpt_oss_transposed_interleaved_biased(checkpoints):
    family = "gpt_oss"
    model = build_tiny_model(family)
    experts = model.model.layers[0].mlp.experts
    assert experts.is_transposed and not experts.is_concatenated and experts.has_bias
    index = CheckpointIndex.open(checkpoints(family, "fused"), meta_model(family))
    prefix = "model.layers.0.mlp.experts."
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    shapes = {"gate_up_proj": (hidden, 2 * inter), "gate_up_proj_bias": (2 * inter,),
              "down_proj": (inter, hidden), "down_proj_bias": (hidden,)}
    for pname, shape in shapes.items():
        name = prefix + pname
        assert index.is_fused_expert(name)
        for e in (0, 7):
            src = index.expert_source(name, e)
            assert src.shape == shape
            assert torch.equal(src.read(), getattr(experts, pname)[e].detach())
    # interleaved gate/up columns are kept as they are: even columns gate, odd columns up
    got = index.expert_source(prefix + "gate_up_proj", 3).read()
    assert torch.equal(got[:, ::2], experts.gate_up_proj[3, :, ::2].detach())
    assert not index.is_fused_expert("model.layers.0.mlp.router.weight")


@pytest.mark.parametrize("layout", ["fused", "legacy"])
@pytest.mark.parametrize("disk_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_disk(tmp_path, layout, disk_dtype):
    path = save("mixtral", tmp_path, layout, dtype=disk_dtype)
    reference = build_tiny_model("mixtral", dtype=disk_dtype).state_dict()
    index = CheckpointIndex.open(path, meta_model("mixtral"))
    for name in index.names:
        src = index.source(name)
        assert src.dtype == disk_dtype
        assert src.nbytes == reference[name].numel() * 2
        assert torch.equal(src.read(), reference[name])
        got = src.read(torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, reference[name].float())
    name = GATE_UP.format(0)
    out = torch.zeros(index.expert_source(name, 2).shape, dtype=torch.float32)
    index.expert_source(name, 2).read(out=out)
    assert torch.equal(out, reference[name][2].float())


def test_tied_embeddings_read_the_tied_source(tmp_path):
    path = save("mixtral", tmp_path, tie_word_embeddings=True)
    index = CheckpointIndex.open(path, meta_model("mixtral", tie_word_embeddings=True))
    assert "lm_head.weight" in index.names
    lm_head = index.source("lm_head.weight")
    assert lm_head.name == "lm_head.weight"
    assert [p.key for p in lm_head.pieces] == ["model.embed_tokens.weight"]
    ref = build_tiny_model("mixtral", tie_word_embeddings=True)
    assert torch.equal(lm_head.read(), ref.lm_head.weight.detach())


# ------------------------------------------------------------------------------------------
# reading details
# ------------------------------------------------------------------------------------------


def test_read_into_out_checks_shape_and_dtype(checkpoints):
    index = CheckpointIndex.open(checkpoints("mixtral", "fused"), meta_model("mixtral"))
    src = index.expert_source(GATE_UP.format(0), 0)
    with pytest.raises(ValueError, match="shape"):
        src.read(out=torch.empty(3, 3))
    with pytest.raises(ValueError, match="dtype"):
        src.read(torch.float16, out=torch.empty(src.shape))
    out = torch.empty(src.shape, dtype=torch.bfloat16)  # conversion through a staging buffer
    assert torch.equal(src.read(out=out), src.read().to(torch.bfloat16))
    whole = index.source(GATE_UP.format(0))
    assert torch.equal(whole.read(out=torch.empty(whole.shape)), whole.read())


def test_hand_made_pieces_and_concat_along_inner_dim(tmp_path):
    a, b = torch.randn(3, 4), torch.randn(3, 5)
    file = str(tmp_path / "x.safetensors")
    save_file({"a": a, "b": b, "stack": torch.randn(4, 3, 2)}, file)
    pieces = (Piece(file, "a"), Piece(file, "b"))  # located lazily from the header
    src = Source("ab", None, (3, 9), torch.float32, pieces, 1, (12 + 15) * 4)
    assert torch.equal(src.read(), torch.cat([a, b], dim=1))
    block = Piece(file, "stack", (2,)).located()
    assert block.shape == (3, 2) and block.nbytes == 24
    with pytest.raises(LoadError, match="'nope'.*x.safetensors"):
        Piece(file, "nope").located()


def test_read_sources_coalesces_back_to_back_pieces(tmp_path, monkeypatch):
    """Several sources in one call: back-to-back pieces are one preadv (scattered into the
    outputs, also across sources), short reads continue where they stopped, a dtype change
    goes through staging."""
    t = {k: torch.randn(n, 4) for k, n in (("e0.w1", 3), ("e0.w2", 2), ("e0.w3", 3), ("z", 5))}
    file = str(tmp_path / "x.safetensors")
    save_file(t, file)
    gate_up = Source("gu", 0, (6, 4), torch.float32, (Piece(file, "e0.w1"), Piece(file, "e0.w3")), 0, 24 * 4)
    down = Source("d", 0, (2, 4), torch.float32, (Piece(file, "e0.w2"),), None, 8 * 4)
    z = Source("z", None, (5, 4), torch.float32, (Piece(file, "z"),), None, 20 * 4)
    calls, real = [], os.preadv

    def short_preadv(fd, views, offset):      # at most 20 bytes per call
        calls.append(len(views))
        first = memoryview(views[0])[:20]
        return real(fd, [first], offset)

    outs = [torch.empty(6, 4), torch.empty(2, 4), torch.empty(5, 4, dtype=torch.bfloat16)]
    read_sources([(gate_up, outs[0]), (down, outs[1]), (z, outs[2])])
    assert torch.equal(outs[0], torch.cat([t["e0.w1"], t["e0.w3"]])) and torch.equal(outs[1], t["e0.w2"])
    assert torch.equal(outs[2], t["z"].bfloat16())
    monkeypatch.setattr(os, "preadv", lambda fd, views, offset: calls.append(len(views)) or real(fd, views, offset))
    read_sources([(gate_up, outs[0]), (down, outs[1])])
    assert calls == [3]                           # w1, w2, w3 are back to back in the file: one call
    calls.clear()
    monkeypatch.setattr(os, "preadv", short_preadv)
    again = [torch.empty(6, 4), torch.empty(2, 4)]
    read_sources([(gate_up, again[0]), (down, again[1])])
    assert torch.equal(again[0], outs[0]) and torch.equal(again[1], outs[1]) and len(calls) == 3 + 2 + 3   # 48, 32, 48 bytes, 20 per call


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")
def test_read_sources_without_readahead_opens_files_random_access(tmp_path, monkeypatch):
    """``pipeline.disk_readahead: false`` -> every file read is opened POSIX_FADV_RANDOM (the
    kernel reads only the bytes asked for); the data is the same."""
    t = {"a": torch.randn(3, 4), "b": torch.randn(2, 4)}
    file = str(tmp_path / "x.safetensors")
    save_file(t, file)
    a = Source("a", None, (3, 4), torch.float32, (Piece(file, "a"),), None, 48)
    advice, real = [], os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: advice.append(how) or real(fd, off, n, how))
    out = torch.empty(3, 4)
    read_sources([(a, out)])
    assert advice == [] and torch.equal(out, t["a"])
    read_sources([(a, out)], readahead=False)
    assert advice == [os.POSIX_FADV_RANDOM] and torch.equal(out, t["a"])


def test_truncated_after_open_fails_on_read(tmp_path):
    path, file, _ = mixtral_file(tmp_path, "fused")
    index = CheckpointIndex.open(path, meta_model("mixtral"))
    last = max(index.names, key=lambda n: index.source(n).pieces[0].offset)
    os.truncate(file, os.path.getsize(file) - 16)
    with pytest.raises(LoadError) as err:
        index.source(last).read()
    assert str(file) in str(err.value) and index.source(last).pieces[0].key in str(err.value)


# ------------------------------------------------------------------------------------------
# errors at open()
# ------------------------------------------------------------------------------------------


def test_missing_tensor(tmp_path):
    path, file, tensors = mixtral_file(tmp_path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(file))
    with pytest.raises(LoadError) as err:
        CheckpointIndex.open(path, meta_model("mixtral"))
    msg = str(err.value)
    assert "tensor 'model.layers.1.self_attn.k_proj.weight' not found in checkpoint" in msg
    assert str(path) in msg and "model.safetensors" in msg


def test_missing_expert_key(tmp_path):
    path, file, tensors = mixtral_file(tmp_path)
    del tensors["model.layers.0.block_sparse_moe.experts.6.w3.weight"]
    save_file(tensors, str(file))
    with pytest.raises(LoadError) as err:
        CheckpointIndex.open(path, meta_model("mixtral"))
    msg = str(err.value)
    assert f"tensor '{GATE_UP.format(0)}' not found" in msg and "expert 6" in msg and "w3" in msg


def test_mis_shaped_tensor(tmp_path):
    path, file, tensors = mixtral_file(tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    expected = list(tensors[name].shape)
    tensors[name] = tensors[name][:-2].clone()
    save_file(tensors, str(file))
    with pytest.raises(LoadError) as err:
        CheckpointIndex.open(path, meta_model("mixtral"))
    msg = str(err.value)
    assert f"'{name}'" in msg and str(file) in msg
    assert str(expected) in msg and str([expected[0] - 2, expected[1]]) in msg


def test_mis_shaped_expert_key(tmp_path):
    path, file, tensors = mixtral_file(tmp_path)
    key = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    tensors[key] = tensors[key][:, :-1].clone()  # [I, H-1]
    save_file(tensors, str(file))
    with pytest.raises(LoadError) as err:
        CheckpointIndex.open(path, meta_model("mixtral"))
    msg = str(err.value)
    assert f"'{GATE_UP.format(1)}' expert 2" in msg and key in msg and str(file) in msg
    assert "[64, 64]" in msg and "[32, 63]" in msg


def test_too_many_experts_in_checkpoint(tmp_path):
    path, file, tensors = mixtral_file(tmp_path)
    for w in ("w1", "w2", "w3"):
        tensors[f"model.layers.0.block_sparse_moe.experts.8.{w}.weight"] = tensors[
            f"model.layers.0.block_sparse_moe.experts.0.{w}.weight"].clone()
    save_file(tensors, str(file))
    with pytest.raises(LoadError) as err:
        CheckpointIndex.open(path, meta_model("mixtral"))
    msg = str(err.value)
    assert "expected shape [8, 64, 64], found [9, 64, 64]" in msg
    assert "experts.8.w1.weight" in msg and str(file) in msg


@pytest.mark.parametrize("layout", ["fused", "sharded-legacy"])
def test_truncated_file_fails_at_open(tmp_path, layout):
    path = save("mixtral", tmp_path, layout)
    files = sorted(path.glob("*.safetensors"))
    victim = files[len(files) // 2]
    os.truncate(victim, os.path.getsize(victim) - 7)
    with pytest.raises(LoadError, match="truncated") as err:
        CheckpointIndex.open(path, meta_model("mixtral"))
    assert str(victim) in str(err.value)


def test_garbage_file(tmp_path):
    path, file, _ = mixtral_file(tmp_path)
    file.write_bytes(b"\xff" * 5)
    with pytest.raises(LoadError, match=re.escape(str(file))):
        CheckpointIndex.open(path, meta_model("mixtral"))


def _rewrite_header(file, edit) -> None:
    """Rewrite ``file``'s safetensors header through ``edit(header)``, its data bytes unchanged."""
    import json
    import struct

    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def test_overlapping_tensors_are_refused(tmp_path):
    """Two tensors whose header ranges share bytes (one expert would read another's weights) are
    refused at open, as ``safetensors`` and transformers refuse them: the file and tensor named."""
    path, file, _ = mixtral_file(tmp_path)
    victim, other = "model.layers.0.block_sparse_moe.experts.1.w1.weight", "model.layers.0.block_sparse_moe.experts.0.w1.weight"

    def share(header):
        header[victim]["data_offsets"] = header[other]["data_offsets"]

    _rewrite_header(file, share)
    with pytest.raises(LoadError, match="invalid offset") as err:
        CheckpointIndex.open(path, meta_model("mixtral"))
    assert str(file) in str(err.value) and "not a valid safetensors file" in str(err.value)


def test_trailing_bytes_are_refused(tmp_path):
    """Bytes past the last tensor: safetensors refuses the file, so kinject does too."""
    path, file, _ = mixtral_file(tmp_path)
    with open(file, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(LoadError, match=re.escape(str(file))):
        CheckpointIndex.open(path, meta_model("mixtral"))


def test_no_checkpoint(tmp_path):
    with pytest.raises(LoadError, match="no safetensors checkpoint"):
        CheckpointIndex.open(tmp_path, meta_model("mixtral"))


# (family, extra checkpoint key, whether transformers ignores it on load for that family)
UNEXPECTED = [
    ("mixtral", "model.layers.0.block_sparse_moe.extra_stat", False),
    ("mixtral", "model.layers.1.self_attn.rotary_emb.inv_freq", True),    # has a rotary_emb.inv_freq buffer
    ("deepseek_v3", "model.layers.61.mlp.gate.weight", True),            # its _keys_to_ignore_on_load_unexpected (MTP)
    ("mixtral", "model.layers.61.mlp.gate.weight", False),               # ... which Mixtral does not have
]


@pytest.mark.parametrize("family,key,ignored", UNEXPECTED, ids=[f"{f}-{k}" for f, k, _ in UNEXPECTED])
def test_unexpected_key_is_an_error_unless_transformers_ignores_it(tmp_path, caplog, request, family, key, ignored):
    """A checkpoint key no model tensor uses is a LoadError naming the key, its file and the closest
    model names, raised at open (headers only); a key transformers' own loader ignores for the model
    is a debug log. transformers' loading report is checked to agree on which is which."""
    from transformers import AutoModelForCausalLM

    path = save(family, tmp_path / "ckpt")
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors[key] = torch.zeros(3)
    save_file(tensors, str(file))
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert (not info["unexpected_keys"]) == ignored                 # the rule is transformers' own (renamed keys)
    if ignored:
        with caplog.at_level(logging.DEBUG, logger="kinject.io.checkpoint"):
            index = CheckpointIndex.open(path, meta_model(family))
        assert key not in index.names and key in caplog.text
        return
    with pytest.raises(LoadError) as err:
        CheckpointIndex.open(path, meta_model(family))
    msg = str(err.value)
    assert f"'{key}' (in model.safetensors; closest model names: " in msg, msg
    request.getfixturevalue("nothing_read")                        # from_pretrained: refused before any read
    with pytest.raises(LoadError, match=re.escape(f"'{key}' (in model.safetensors")):
        kinject.from_pretrained(path, "rules/resident.yaml")


def test_unexpected_keys_error_lists_each_file(tmp_path):
    """Keys spread over shards: the error names every file they are in, and counts them all."""
    path = save("mixtral", tmp_path / "ckpt", "sharded-fused")
    shards = sorted(path.glob("model-*.safetensors"))
    for i, shard in enumerate(shards[:2]):
        tensors = load_file(str(shard))
        tensors[f"model.layers.{i}.mlp.stray_{i}"] = torch.zeros(2)
        save_file(tensors, str(shard))
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"].update({f"model.layers.{i}.mlp.stray_{i}": s.name for i, s in enumerate(shards[:2])})
    index_file.write_text(json.dumps(index))
    with pytest.raises(LoadError, match=rf"2 key\(s\) in {shards[0].name}, {shards[1].name} that no tensor"):
        CheckpointIndex.open(path, meta_model("mixtral"))


def test_unknown_names(checkpoints):
    index = CheckpointIndex.open(checkpoints("mixtral", "fused"), meta_model("mixtral"))
    with pytest.raises(KeyError, match="closest"):
        index.source("model.layers.0.mlp.experts.gate_up")
    with pytest.raises(ValueError, match="not a fused expert"):
        index.expert_source("model.norm.weight", 0)
    with pytest.raises(IndexError):
        index.expert_source(GATE_UP.format(0), 8)


def test_interleaved_expert_reads_lazily(tmp_path):
    """transformers' ``Interleave(dim=1)`` (gate and up rows alternating on disk) is one strided
    read per expert: the same tensor transformers' own conversion makes."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import Interleave


    stored = torch.randn(3, 8, 5)                                     # [E, 2I, H], interleaved
    save_file({"w13": stored}, str(tmp_path / "m.safetensors"))
    want = Interleave(dim=1).convert({"w13": stored}, ["w13"], ["gate_up_proj"])["gate_up_proj"]
    for e in range(3):
        piece = Piece(str(tmp_path / "m.safetensors"), "w13", (e,)).located()
        src = Source("gate_up_proj", e, (8, 5), piece.dtype, (piece,), None, piece.nbytes, interleave=0)
        assert torch.equal(src.read(), want[e])
    piece = Piece(str(tmp_path / "m.safetensors"), "w13", None).located()
    whole = Source("gate_up_proj", None, (3, 8, 5), piece.dtype, (piece,), None, piece.nbytes, interleave=1)
    assert torch.equal(whole.read(), want)
