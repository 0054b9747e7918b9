"""The experts operator and the KV cache are compositions (docs/architecture.md, "Experts", "The KV
cache"): each piece gets what it needs passed in, reads no other object's private attributes, asks
the store about a unit's state instead of reading the fields the store's lock guards, and no KV
layer refers back to the cache."""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PIECES = sorted([*ROOT.glob("operators/expert*.py"), ROOT / "operators/host_experts.py", ROOT / "operators/base.py",
                 ROOT / "operators/kt_backend.py", *ROOT.glob("kinject/kv/*.py")])
# private names of other libraries' objects the pieces use on purpose (``_forward_hooks`` /
# ``_forward_pre_hooks``: whether a SiLU act_fn has hooks, which a fused gate would skip; torch
# keeps them private and offers no public question)
FOREIGN = {"_C", "_cdata", "_base", "_grouped_mm", "_apply_gate", "_parameters", "_forward_hooks", "_forward_pre_hooks"}
GUARDED = {"handle", "offloaded"}        # Unit fields the store's lock guards (``device`` checked below)


def _attributes(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute):
            yield node


def test_the_pieces_read_no_private_attribute_of_another_object():
    found = []
    for path in PIECES:
        for node in _attributes(path):
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in FOREIGN:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "a piece reads another object's private state:\n" + "\n".join(found)


def test_operators_ask_the_store_about_a_units_state():
    """``Unit.device / handle / offloaded`` are read by the store only (``TensorStore.placed``, ``ready``,
    ``offloaded``, ``own_tensors`` ... answer for the operators). ``binding.offloaded`` is the
    binding's own question, answered by the store."""
    found = []
    for path in sorted(ROOT.glob("operators/*.py")):
        for node in _attributes(path):
            value = ast.unparse(node.value)
            unit_like = value in ("u", "unit", "head") or value.startswith("units[") or value.endswith(".unit")
            asks = value.endswith(("binding", "store")) or value == "self"     # the binding's or the store's question
            if node.attr in GUARDED and not asks or \
                    node.attr == "device" and unit_like:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "an operator reads a unit's guarded state:\n" + "\n".join(found)


def test_the_operator_contract_is_declared_on_the_base():
    from operators.base import Operator
    from operators.experts import GroupedExperts

    for hook in ("check_kwargs", "owned_descendants", "accepts", "from_module"):
        assert hook in vars(Operator), f"Operator does not declare {hook}"
    assert Operator.owned_descendants(torch.nn.Linear(2, 2), {}) == []
    assert Operator.check_kwargs({"anything": 1}) is None
    assert Operator.serves_moe is False and GroupedExperts.serves_moe is True
    assert {"attach", "detach"} <= Operator.__abstractmethods__                 # how weights go to the store and back


def test_a_rule_naming_an_operator_without_attach_and_detach_is_refused():
    from kinject.rules import check_operator_kwargs
    from operators.base import Operator

    class Half(Operator):
        def attach(self):
            super().attach()

    key, message = check_operator_kwargs(Half, {})
    assert key is None and "does not implement detach" in message


def _refers_to(holder, target) -> bool:
    """Whether ``holder`` holds ``target`` directly, in its attribute dict, or through a weakref."""
    refs = gc.get_referents(holder)
    refs += [r for d in refs if isinstance(d, dict) for r in d.values()]
    return any(r is target or isinstance(r, weakref.ref) and r() is target for r in refs)


def test_kv_layers_share_an_arena_and_hold_no_reference_to_the_cache(tmp_path):
    from kinject.engine.transfer import TransferEngine
    from kinject.kv import KVCache, KVSpec
    from kinject.testing import tiny_config

    with TransferEngine("cpu") as engine:
        cache = KVCache(tiny_config("mixtral"), specs=lambda i: KVSpec("disk"), transfer=engine, capacity=8,
                        offload_dir=tmp_path)
        arena = cache.arena
        assert all(layer.arena is arena for layer in cache.layers) and arena.layers == list(cache.layers)
        assert not any(_refers_to(holder, cache) for holder in (*cache.layers, arena))
        arena.alloc((2, 3), torch.float32, "disk", "probe")
        files = arena.disk_dir
        assert files is not None and any(files.iterdir())
        layer, arena_ref = weakref.ref(cache.layers[0]), weakref.ref(arena)
        del cache, arena
        assert layer() is None and arena_ref() is None     # freed with the cache (no cycle kept alive)
        assert not files.exists()                          # its disk-tier files went with it
