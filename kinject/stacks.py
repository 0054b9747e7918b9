"""Stacks of repeated blocks, and the pipeline positions operators take in them.

A model is one or more *stacks*: outermost ``ModuleList``s of blocks (decoder layers, encoder
layers, vision / audio tower blocks, a talker beside a thinker; a mixed-attention decoder mixes block
classes in one stack). They are found from the module tree, never from a family list; a stack is
named by its dotted path. A pipeline
*position* is (stack, index), plus, where one block holds several MoE blocks (per-modality
experts), the MoE block's path inside it.

Operators, the store, the scheduler's bookkeeping and the correlation table count positions as
integers (*ordinals*) in the order the model runs them: stacks in module-tree order, with the
towers beside the decoder (``model.get_decoder()``) moved before it where the tree holds them
after (a tower runs at prefill before the decoder reads its output; the tests record the order
blocks run in, for encoder-decoders and for vision-language models given images), blocks in index
order, and a block's MoE blocks in tree order, each its own ordinal. A model with one stack and at most one MoE block
per block has ordinal ==
block index, the decoder-layer number.

    stacks = find_stacks(model)
    stacks.declare("model.language_model.layers.3.mlp.text_moe.gate")     # a router (at construction)
    stacks.position("model.language_model.layers.3.mlp.text_moe.gate", moe=True)
    # Position(stack='model.language_model.layers', index=3, part='mlp.text_moe')
    stacks.ordinal("model.language_model.layers.3.mlp.text_moe.gate", moe=True)   # its integer
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class Position:
    """Where an operator sits: block ``index`` of ``stack``; ``part`` names one of several MoE
    blocks inside it (its path relative to the block), empty otherwise."""

    stack: str
    index: int
    part: str = ""

    def __str__(self) -> str:
        return f"{self.stack}[{self.index}]" + (f".{self.part}" if self.part else "")


@dataclass(frozen=True)
class Stack:
    path: str            # dotted name of the ModuleList
    block_class: str     # class name(s) of its blocks, '/'-joined
    length: int


def _is_stack(module: nn.Module) -> bool:
    """A ``ModuleList`` of blocks: each child has modules of its own (a list of Linear heads is
    not a stack). Mixed-attention decoders mix block classes in one stack (attention and Mamba layers)."""
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        return False
    return all(any(True for _ in child.children()) for child in module)


class Stacks:
    """The stacks of one model and the ordinals of the positions in them."""

    def __init__(self, stacks: list[Stack], tree: dict[str, int] | None = None):
        self.stacks = stacks                          # in execution order
        self._tree = tree or {}                       # module name -> its rank in module-tree order
        self._by_path = {s.path: s for s in stacks}
        self._moe_keys: set[str] = set()              # declared routers and experts modules
        self._ordinals: dict[Position, int] | None = None    # frozen at the first ordinal asked

    # -------------------------------------------------------------- positions

    def block_of(self, key: str) -> tuple[str, int, str] | None:
        """(stack path, block index, path inside the block) of the module named ``key``, or None
        outside every stack (embeddings, the lm_head, a tower's patch embedding)."""
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            stack = ".".join(parts[:cut])
            if stack in self._by_path and parts[cut].isdigit():
                return stack, int(parts[cut]), ".".join(parts[cut + 1:])
        return None

    def position(self, key: str, moe: bool = False) -> Position | None:
        """The position of the module ``key``; ``moe``: it is a router or an experts module,
        whose MoE block (:meth:`moe_block`) makes its own position when a block holds several."""
        found = self.block_of(self.moe_block(key) if moe else key)
        if found is None:
            return None
        stack, index, inner = found
        return Position(stack, index, inner if moe else "")

    def declare(self, key: str) -> None:
        """``key`` is a router or an experts module: it takes a position of its own among its block's
        (numbered when the first ordinal is asked, so every operator declares at construction)."""
        if self._ordinals is not None:
            raise RuntimeError(f"{key!r}: a MoE module declared after positions were numbered")
        self._moe_keys.add(key)

    def moe_block(self, key: str) -> str:
        """The MoE block a declared router / experts module serves: the module itself when another
        declared one sits directly inside it (a block-level experts operator around its router),
        else its parent (the router's and the experts' common block)."""
        if any(k.rpartition(".")[0] == key for k in self._moe_keys):
            return key
        return key.rpartition(".")[0]

    def ordinal(self, key: str, moe: bool = False) -> int | None:
        """The integer of ``key``'s position, in execution order (None outside every stack).
        A block's first ordinal stands for the block itself (its attention, dense MLP ...)."""
        pos = self.position(key, moe)
        if pos is None:
            return None
        table = self._numbered()
        if pos.part and pos in table:
            return table[pos]
        return table[Position(pos.stack, pos.index)]

    def _numbered(self) -> dict[Position, int]:
        if self._ordinals is None:
            parts: dict[tuple[str, int], set[str]] = {}      # (stack, index) -> its MoE blocks
            for key in self._moe_keys:
                pos = self.position(key, moe=True)
                if pos is not None:
                    parts.setdefault((pos.stack, pos.index), set()).add(pos.part)
            table, n = {}, 0
            for s in self.stacks:
                for i in range(s.length):
                    table[Position(s.path, i)] = n
                    mine = sorted(parts.get((s.path, i), ()),
                                  key=lambda part: (self._tree.get(f"{s.path}.{i}.{part}", 0), part))
                    for j, part in enumerate(mine):
                        table[Position(s.path, i, part)] = n + j
                    n += max(1, len(mine))
            self._ordinals = table
        return self._ordinals

    def __iter__(self):
        return iter(self.stacks)

    def __len__(self) -> int:
        return len(self.stacks)

    def __repr__(self) -> str:
        return "Stacks(" + ", ".join(f"{s.path}[{s.length} x {s.block_class}]" for s in self.stacks) + ")"


def find_stacks(model: nn.Module) -> Stacks:
    """Every outermost stack of ``model``, in the order they run: module-tree order, except that a
    tower beside the decoder (a sibling under the decoder's parent: vision / audio encoders, which
    run at prefill before the decoder reads their output) comes before the decoder's stacks even
    where the module tree holds it after them. The decoder is the model's own ``get_decoder()``."""
    found = _tree_stacks(model)
    tree = {name: i for i, (name, _) in enumerate(model.named_modules(remove_duplicate=True))}
    decoder = _decoder_path(model)
    if decoder:
        parent = decoder.rpartition(".")[0]
        inside = lambda s: s.path.startswith(decoder + ".")                        # noqa: E731
        beside = lambda s: not inside(s) and (not parent or s.path.startswith(parent + "."))   # noqa: E731
        first = next((i for i, s in enumerate(found) if inside(s)), None)
        if first is not None:
            late = [s for s in found[first:] if beside(s)]
            found = found[:first] + late + [s for s in found[first:] if not beside(s)]
    logger.debug("stacks: %s", found)
    return Stacks(found, tree)


def _decoder_path(model: nn.Module) -> str | None:
    """Dotted name of the module ``model.get_decoder()`` returns (transformers' own answer to
    "which part generates"), if the model has one and it is not the model itself."""
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except Exception:  # noqa: BLE001 -- a model without a decoder of its own may raise anything here
        return None
    if decoder is None or decoder is model:
        return None
    return next((name for name, m in model.named_modules() if m is decoder), None)


def _tree_stacks(model: nn.Module) -> list[Stack]:
    """Outermost stacks in module-tree order."""
    found: list[Stack] = []
    for name, module in model.named_modules(remove_duplicate=True):
        if not name or any(name.startswith(s.path + ".") for s in found):
            continue                                 # inside a stack's block: experts lists, sub-layers
        if _is_stack(module):
            found.append(Stack(name, "/".join(sorted({type(b).__name__ for b in module})), len(module)))
    return found
