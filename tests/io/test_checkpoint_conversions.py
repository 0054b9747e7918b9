"""kinject.io.checkpoint: checkpoints that need transformers' conversion operations.

A fused key cut into several targets (``Split``/``Chunk(dim=0)``: sarvam_moe's ``query_key_value``,
lara_mini's ``in_proj``, hrm_text's ``gqkv_proj``) is read lazily, each target a row range of the
key; any other conversion (inkling2's unpadded vocabulary, inkling2_loop's merged message
queries) is run eagerly by transformers' own operations. Either way kinject must read exactly the
tensor transformers' ``from_pretrained`` loads.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from kinject import families
from kinject.errors import LoadError
from kinject.engine.disk_sources import read_sources
from kinject.io.checkpoint import CheckpointIndex
from kinject.io.loading import parameters_on_meta

QKV = "model.layers.0.self_attn.{}_proj.weight"
IN_PROJ = "model.layers.0.linear_attn.in_proj_{}.weight"
# (model_type, config overrides, dtype on disk) -> targets that need a conversion, and how each is read
CASES = {
    ("sarvam_moe", (), torch.float32): {QKV.format(p): "split" for p in "qkv"},
    ("lara_mini", (), torch.float32): {IN_PROJ.format(p): "split" for p in ("qkv", "z", "b", "a")},
    ("hrm_text", (), torch.float32): {  # Chunk(dim=0): equal parts
        "model.H_module.layers.0.self_attn.gate_proj.weight": "split",
        "model.L_module.layers.0.self_attn.v_proj.weight": "split",
        "model.L_module.layers.0.mlp.up_proj.weight": "split",
    },
    ("inkling2_text", (("unpadded_vocab_size", 500),), torch.float32): {"lm_head.weight": "eager"},
    ("inkling2_text", (("unpadded_vocab_size", 500),), torch.bfloat16): {"lm_head.weight": "eager"},
    ("inkling2_loop_text", (), torch.float32): {"model.message_input.query": "eager"},
}


def _save(model_type: str, path, overrides=(), dtype=torch.float32):
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:              # a family newer than this transformers (>= 5.17 supported)
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {model_type}")
    model = families.build_tiny_family_model(model_type, **dict(overrides)).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path)                                  # the family's own format
    return path


def _open(path, dtype=torch.float32) -> CheckpointIndex:
    """The index of ``path`` for its model built on meta, as ``kinject.from_pretrained`` builds it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    return CheckpointIndex.open(path, model)


def _loaded(path, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """What transformers' own ``from_pretrained`` loads."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint per case, shared by the module's tests."""
    cache: dict = {}

    def get(model_type: str, overrides=(), dtype=torch.float32):
        if (model_type, overrides, dtype) not in cache:
            path = tmp_path_factory.mktemp(model_type)
            cache[model_type, overrides, dtype] = _save(model_type, path, overrides, dtype)
        return cache[model_type, overrides, dtype]

    return get


@pytest.mark.parametrize("case", list(CASES), ids=[f"{m}-{str(d).split('.')[-1]}" for m, _, d in CASES])
def test_converted_targets_read_as_transformers_loads_them(saved, case):
    path = saved(*case)
    index, reference = _open(path), _loaded(path)
    assert sorted(index.names) == sorted(reference)
    for name, want in reference.items():
        src = index.source(name)
        assert src.shape == tuple(want.shape), name
        assert torch.equal(src.read(want.dtype), want), name                  # exact bits
    for name, how in CASES[case].items():
        src, want = index.source(name), reference[name]
        if how == "split":                                                    # a byte range of the fused key
            assert src.convert is None and len(src.pieces) == 1 and src.pieces[0].rows is not None
            assert src.nbytes == want.numel() * src.dtype.itemsize
        else:                                                                 # transformers' operations
            assert src.convert is not None and src.dtype == want.dtype
        out = torch.empty_like(want)
        assert src.read(out=out) is out and torch.equal(out, want)


@pytest.mark.parametrize("model_type,template,part", [
    ("sarvam_moe", QKV, "k"), ("sarvam_moe", QKV, "v"), ("lara_mini", IN_PROJ, "z"), ("lara_mini", IN_PROJ, "a"),
])
def test_rows_of_a_split_target_read_only_their_bytes(saved, model_type, template, part):
    path = saved(model_type)
    index, want = _open(path), _loaded(path)[template.format(part)]
    name = template.format(part)
    whole = index.source(name).pieces[0]
    row_bytes = want[0].numel() * 4
    for start, stop in [(0, want.shape[0]), (1, 3), (want.shape[0] - 1, want.shape[0])]:
        src = index.rows_source(name, start, stop)
        assert src.shape == tuple(want[start:stop].shape) and torch.equal(src.read(), want[start:stop])
        assert src.nbytes == (stop - start) * row_bytes
        assert src.pieces[0].offset == whole.offset + start * row_bytes
    last = want.shape[0] - 1
    src = index.rows_source(name, last, last + 1, squeeze=True)
    assert src.expert == last and torch.equal(src.read(), want[last]) and src.nbytes == row_bytes
    with pytest.raises(IndexError):
        index.rows_source(name, 0, want.shape[0] + 1)                        # not into the next target's rows


def test_rows_of_an_eagerly_converted_target(saved):
    path = saved("inkling2_text", (("unpadded_vocab_size", 500),))
    index, want = _open(path), _loaded(path)["lm_head.weight"]                # [500, H] of the [512, H] key
    assert torch.equal(index.rows_source("lm_head.weight", 490, 500).read(), want[490:500])
    assert torch.equal(index.rows_source("lm_head.weight", 7, 8, squeeze=True).read(), want[7])


def test_read_sources_mixes_converted_and_lazy_sources(saved):
    ink = saved("inkling2_text", (("unpadded_vocab_size", 500),))
    sarvam = saved("sarvam_moe")
    ink_index, sarvam_index = _open(ink), _open(sarvam)
    head, k = _loaded(ink)["lm_head.weight"], _loaded(sarvam)[QKV.format("k")]
    converted, split = ink_index.source("lm_head.weight"), sarvam_index.rows_source(QKV.format("k"), 2, 6)
    outs = [torch.empty(head.shape, dtype=torch.bfloat16), torch.empty(4, k.shape[1])]
    read_sources([(converted, outs[0]), (split, outs[1])])
    assert torch.equal(outs[0], head.to(torch.bfloat16)) and torch.equal(outs[1], k[2:6])
    with pytest.raises(ValueError, match="converted after reading"):
        converted.placements(outs[0])


def _rewrite(path, key: str, edit) -> str:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors[key] = edit(tensors[key]).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})
    return str(file)


def test_fused_key_with_wrong_rows_is_refused(tmp_path):
    path = _save("sarvam_moe", tmp_path / "ckpt")
    key = "model.layers.0.attention.query_key_value.weight"
    file = _rewrite(path, key, lambda t: t[:-8])                              # [120, H] for q + k + v = 128 rows
    with pytest.raises(LoadError) as err:
        _open(path)
    msg = str(err.value)
    assert key in msg and file in msg and "120" in msg and "128" in msg
    assert all(f"'{QKV.format(p)}'" in msg for p in "qkv")


def test_chunked_key_with_wrong_rows_is_refused(tmp_path):
    path = _save("hrm_text", tmp_path / "ckpt")
    key = "model.L_module.layers.0.mlp.gate_up_proj.weight"
    file = _rewrite(path, key, lambda t: t[:-2])                              # [254, H]: parts of 127 rows
    with pytest.raises(LoadError) as err:
        _open(path)
    msg = str(err.value)
    assert key in msg and file in msg and "[128, 64]" in msg and "[127, 64]" in msg
    assert all(f"'model.L_module.layers.0.mlp.{p}_proj.weight'" in msg for p in ("gate", "up"))


def test_eager_conversion_with_wrong_shape_is_refused(tmp_path):
    path = _save("inkling2_text", tmp_path / "ckpt", (("unpadded_vocab_size", 500),))
    _rewrite(path, "model.llm.unembed.weight", lambda t: t[:, :60])           # [512, 60] for [500, 64]
    with pytest.raises(LoadError, match=r"'lm_head\.weight'.*\[500, 64\].*\[500, 60\].*Inkling2UnpadVocab.*"
                                        r"'model\.llm\.unembed\.weight' \[512, 60\]"):
        _open(path)


def test_eager_conversion_failing_on_the_keys_shapes_is_refused_at_open(tmp_path):
    path = _save("inkling2_loop_text", tmp_path / "ckpt")
    key = "model.llm.middle_cycle_cross_pass_kv_queries"
    _rewrite(path, key, lambda t: t[:-2])                                     # 11 loop layers' k/v, 12 of q/mlp
    with pytest.raises(LoadError, match=rf"'model\.message_input\.query'.*Inkling2LoopMergeMessageQueries.*'{key}'"):
        _open(path)


def test_conversion_that_needs_the_data_is_checked_when_read(tmp_path, monkeypatch):
    """An operation that cannot run on meta tensors: its result's shape is checked when read."""
    Inkling2UnpadVocab = getattr(pytest.importorskip("transformers.core_model_loading"), "Inkling2UnpadVocab", None)
    if Inkling2UnpadVocab is None:
        pytest.skip("this transformers has no Inkling2UnpadVocab")

    original = Inkling2UnpadVocab.convert

    def needs_data(self, input_dict, *args, **kwargs):
        if next(iter(input_dict.values()))[0].is_meta:
            raise NotImplementedError("Cannot copy out of meta tensor; no data!")
        return original(self, input_dict, *args, **kwargs)

    monkeypatch.setattr(Inkling2UnpadVocab, "convert", needs_data)
    path = _save("inkling2_text", tmp_path / "ckpt", (("unpadded_vocab_size", 500),))
    assert torch.equal(_open(path).source("lm_head.weight").read(), _loaded(path)["lm_head.weight"])
    _rewrite(path, "model.llm.unembed.weight", lambda t: t[:, :60])
    src = _open(path).source("lm_head.weight")                                # not refused: the data is needed
    with pytest.raises(LoadError, match=r"'lm_head\.weight'.*\[500, 64\].*\[500, 60\].*Inkling2UnpadVocab"):
        src.read()


def test_fused_expert_parameter_is_never_converted_eagerly(tmp_path):
    """Experts are read one at a time: a conversion of all of them at once stays refused."""
    path = _save("inkling2_loop_text", tmp_path / "ckpt")
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.llm.layers.0.mlp.experts.w13_weight_scale"] = torch.ones(8, 96, 2)   # an MXFP8 scale
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(LoadError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj'.*w13_weight_scale"
                                        r".*cannot read lazily"):
        _open(path)


def test_text_and_vision_experts_split_from_one_list_read_per_expert(tmp_path):
    """ERNIE-4.5-VL's checkpoint keeps one list of per-expert keys (text experts, then vision ones)
    that ``ErnieFuseAndSplitTextVisionExperts`` stacks, cuts into the two targets and fuses (gate,
    up): each expert reads lazily only its own keys' bytes, exactly what transformers loads."""
    from kinject import modal_families

    model_type = "ernie4_5_vl_moe"
    if model_type not in modal_families.modal_moe_families():
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {model_type}")
    model = modal_families.build_tiny_modal_model(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path)
        loaded = type(model).from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    on_disk = load_file(tmp_path / "model.safetensors")
    with parameters_on_meta():
        meta = type(model)(model.config)
    index = CheckpointIndex.open(tmp_path, meta)
    fused = [n for n in loaded if n.endswith(("_moe.experts.gate_up_proj", "_moe.experts.down_proj"))]
    assert {n.rsplit(".", 3)[-3] for n in fused} == {"text_moe", "vision_moe"}
    for name in fused:
        assert index.is_fused_expert(name) and index.num_experts(name) == loaded[name].shape[0]
        for e in range(index.num_experts(name)):
            src = index.expert_source(name, e)
            assert src.convert is None and src.nbytes == loaded[name][e].numel() * 4, (name, e)
            assert torch.equal(src.read(torch.float32), loaded[name][e]), (name, e)
    text, vision = (next(n for n in fused if f"{kind}_moe.experts.gate_up_proj" in n) for kind in ("text", "vision"))
    layer = text.split(".mlp.")[0].replace("language_model.", "")
    run = loaded[text].shape[0]                                     # vision expert 0 is checkpoint expert `run`
    keys = [k for k in on_disk if k.startswith(f"{layer}.mlp.experts.{run}.") and "gate_proj" in k]
    assert keys and torch.equal(loaded[vision][0][: on_disk[keys[0]].shape[0]], on_disk[keys[0]])
