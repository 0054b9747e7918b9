"""Operator base class: what every injectable operator is.

An operator **wraps** the original module (``self.base``) and reuses its math; it adds
placement, prefetch, micro-batching or ordering around it. Construction must not change
the original module (the injector builds every operator before swapping any, so a failed
``optimize`` can leave the model untouched); weights move only in :meth:`Operator.attach`,
which :meth:`Operator.detach` undoes exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from kinject.runtime import Runtime


_PLAIN = frozenset({int, float, bool, str, tuple, list, dict, set, frozenset})   # set per call, never registered
_SETTINGS = frozenset({int, float, bool, str, type(None), torch.dtype})        # a base's attributes read through
_MISSING = object()


class _Resolved:
    """A value an operator resolves once, on first use, then keeps as a plain instance attribute: read
    per call (``Operator.layer``), so later reads are attribute reads, not calls (a non-data descriptor:
    the instance's ``__dict__`` entry wins once set)."""

    def __init__(self, fn):
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __get__(self, op, owner=None):
        if op is None:
            return self
        value = op.__dict__[self.name] = self.fn(op)
        return value


class Operator(nn.Module, ABC):
    """Base of all kinject operators: the extension contract (docs/architecture.md, "Operators").

    A rule's ``replace: {class: ...}`` names a subclass. What the injector and the runtime ask of it,
    each with a default here that a subclass overrides where it differs:

    * rule kwargs: keyword-only constructor parameters with type hints (``weights:
      Literal["device", "host", "disk"] = "host"``): the rule loader checks rule kwargs against that
      signature, so a typo is an error, not a silent no-op; :meth:`check_kwargs` checks values
      beyond types, before anything is built;
    * matching: :meth:`accepts` (whether a matched module is one this operator serves),
      :meth:`owned_descendants` (modules below it that it schedules itself, so no other rule claims
      them), :attr:`serves_moe` (a router or an experts module: its MoE block is a pipeline position);
    * building and the lifecycle: :meth:`from_module` (never changes the module), :meth:`attach`
      (weights to the store) and :meth:`detach` (its exact inverse) -- abstract: every operator says
      how its weights go to the store and back, and calls these with ``super()`` (they register it
      with the runtime) -- and :meth:`forward`;
    * the scheduler's questions: :meth:`offloads`, :meth:`prefetch_units`, :meth:`prefetch_settled`;
      the loader's: :meth:`load_device`.

    An operator asks the store about its units' state through the store's methods
    (``TensorStore.placed``, ``ready``, ``settled``, ``offloaded``, ...): a unit's ``device``,
    ``handle`` and ``offloaded`` fields are the store's, guarded by its lock.
    """

    #: A router or an experts module: its MoE block is a position of its own (several MoE blocks in
    #: one layer, per-modality experts, are distinct positions; a router and its experts share one).
    serves_moe: ClassVar[bool] = False

    def __init__(self, base: nn.Module, *, key: str, runtime: "Runtime"):
        super().__init__()
        self.base = base          # the original HF module, kept as is
        # the same module as a plain attribute, not a second submodule: what the per-step calls read
        # (``self.base`` goes through nn.Module.__getattr__ and this class's own, per call)
        object.__setattr__(self, "_base", base)
        self.key = key            # its dotted name in the original model
        # Not a submodule: the runtime is shared by all operators of one model.
        object.__setattr__(self, "runtime", runtime)
        if self.serves_moe:
            runtime.stacks.declare(key)

    def __setattr__(self, name: str, value) -> None:
        """Plain values (per-step state set on every call: numbers, tuples, lists, dicts, sets) skip
        ``nn.Module.__setattr__``, whose checks cost microseconds per call; anything else (tensors,
        modules, ``None``, other objects) and names registered as parameters, buffers or submodules
        go through it unchanged."""
        if type(value) in _PLAIN and name not in self._parameters and name not in self._buffers \
                and name not in self._modules:
            object.__setattr__(self, name, value)
        else:
            nn.Module.__setattr__(self, name, value)

    def __getattr__(self, name: str):
        """The wrapped module's plain settings, read only (the block around it reads
        ``self.router.num_experts``): numbers, strings, flags and dtypes of ``self.base``, never its
        tensors or submodules -- those live in the store and are bound only while in use."""
        modules = self.__dict__["_modules"]
        if name in modules:                      # self.base and other submodules: as nn.Module does
            return modules[name]
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            base = modules.get("base")
            value = base.__dict__.get(name, _MISSING) if base is not None else _MISSING
            if type(value) in _SETTINGS:
                return value
            raise

    @classmethod
    def check_kwargs(cls, kwargs: dict) -> None:
        """Rule-time checks of the rule's kwargs beyond their types (the loader checked those against
        the constructor's signature): raise ValueError or TypeError, with a ``key`` attribute naming
        the kwarg where one is at fault. Default: none."""

    @classmethod
    def owned_descendants(cls, module: nn.Module, kwargs: dict) -> list[str]:
        """Dotted names (relative to ``module``) of modules below a matched ``module`` that this
        operator schedules itself (a MoE block's experts modules), so no other rule claims them
        (:func:`kinject.inject.match_modules`). Default: none."""
        return []

    @classmethod
    def accepts(cls, module: nn.Module, parent: nn.Module) -> bool:
        """Whether a module a rule matched (by name and class) is what this operator serves, by the
        module tree and shapes; a module declined stays as it is (default: every match)."""
        return True

    @classmethod
    def from_module(cls, base: nn.Module, *, key: str, runtime: "Runtime", **kwargs) -> "Operator":
        """Build the operator for ``base`` (the matched module) without changing ``base``."""
        return cls(base, key=key, runtime=runtime, **kwargs)

    @abstractmethod
    def attach(self) -> None:
        """Apply phase: hand weights to the store, register with the runtime (this body: call it last
        through ``super().attach()``)."""
        self.runtime.register(self)

    @abstractmethod
    def detach(self) -> nn.Module:
        """Exact inverse of :meth:`attach`; returns the original module, weights restored.

        Also called after an ``attach`` that raised halfway, so it must undo whatever part
        of ``attach`` did happen."""
        self.runtime.unregister(self)
        return self.base

    def forward(self, *args, **kwargs):
        return self._base(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"key={self.key!r}"

    @_Resolved
    def layer(self) -> int | None:
        """Pipeline position: an integer in the order the model runs its stacks' blocks
        (:mod:`kinject.stacks`; the decoder-layer index for a model with one stack), None outside
        every stack. Resolved on first use, when every operator of the model has been built."""
        return self.runtime.position(self.key, self.serves_moe)

    def prefetch_units(self) -> list:
        """Units the scheduler prefetches when this operator is next (default: none)."""
        return []

    def prefetch_settled(self) -> bool:
        """Whether every unit :meth:`prefetch_units` could ever return is on the device or on its
        way, so asking again starts nothing until the store forgets a device copy (the scheduler
        then stops asking; see ``Scheduler.enter``). Default: False (always asked)."""
        return False

    def offloads(self) -> bool:
        """Whether any of its weights live off the device: only such operators count toward
        ``pipeline.prefetch_lookahead`` (resident ones have nothing to prefetch)."""
        return False

    def load_device(self) -> torch.device | None:
        """Where :func:`kinject.from_pretrained` reads the tensors of ``base`` that this operator
        left on the meta device (None: the pipeline's compute device)."""
        return None


def check_quant_kwarg(kwargs: dict, *, per_expert: bool = False) -> None:
    """Rule-time check of an operator's ``quant:`` kwarg (a stored format: HQQ, fp8, int4, mxfp4, ...;
    :mod:`kinject.engine.encode`); ValueError naming the key."""
    from kinject.engine.encode import parse_quant

    try:
        parse_quant(kwargs.get("quant"), per_expert=per_expert)
    except ValueError as exc:
        exc.key = "quant"
        raise


class ParamBinding:
    """A module's parameters handed to the store as one unit, bound only while in use.

    ``take`` moves the parameters' data into the store (keeping the original tensors for
    ``give_back``) and leaves storage-less placeholders; ``bind`` points the parameters
    at the device tensors ``acquire`` returned, ``unbind`` back at the placeholders.
    Meta-device parameters (a model built by ``kinject.from_pretrained``) are read from
    the runtime's checkpoint instead, straight into the unit's tier.
    """

    def __init__(self, module: nn.Module, runtime: "Runtime", prefix: str,
                 names: list[str] | None = None):
        self.module, self.runtime, self.prefix = module, runtime, prefix
        params = dict(module.named_parameters())
        self.names = list(params) if names is None else names
        self.params = {n: params[n] for n in self.names}
        self.originals: dict[str, nn.Parameter] = {}   # meta Parameter objects replaced
        self.saved: dict[str, torch.Tensor] = {}       # original data of materialised params
        self.placeholders: dict[str, torch.Tensor] = {}
        self.unit = None
        self.bound_to: dict | None = None               # the tensors the parameters point at, if not placeholders
        self.roles = {n: n for n in self.names}       # parameter -> its role in the unit (a follower: the leader's)
        self.leader: ParamBinding | None = None       # who took these parameters, when they are tied to its module's

    def tie_key(self) -> tuple:
        """The identities of the Parameters taken (tied weights: the same objects in two modules)."""
        return tuple(sorted(id(self.originals.get(n, p)) for n, p in self.params.items()))

    def taken_by_another(self) -> tuple[list, "ParamBinding"] | None:
        """The units another binding already added for these very Parameters (weights tied
        across two claimed modules), now held by this one too and followed (:meth:`follow`)."""
        shared = self.runtime.store.share(self.tie_key())
        if shared is not None:
            self.follow(shared[1])
        return shared

    def follow(self, leader: "ParamBinding") -> None:
        """Bind to ``leader``'s unit instead of adding a copy: this module's parameters become the
        leader's (the same Parameter objects they were tied to, or the leader's replacements of
        meta ones: still tied), with its placeholders. :meth:`restore` then puts back only the
        meta Parameters this module held; the tied tensors' data is the leader's to restore."""
        self.leader = leader
        role_of = {id(leader.originals.get(n, p)): n for n, p in leader.params.items()}
        for n, p in list(self.params.items()):
            role = role_of[id(p)]
            self.roles[n] = role
            self.placeholders[n] = leader.placeholders[role]
            new = leader.params[role]
            if new is not p:
                owner, leaf = _owner(self.module, n)
                self.originals[n] = p
                owner._parameters[leaf] = new
                self.params[n] = new
        self.unit = leader.unit

    def sources(self) -> dict:
        """Name -> tensor (materialised) or disk reference (meta, from the checkpoint)."""
        out = {}
        for n, p in self.params.items():
            out[n] = self.runtime.checkpoint_source(f"{self.prefix}.{n}") if p.is_meta else p.data
        return out

    @property
    def dtype(self) -> torch.dtype | None:
        """The compute dtype of these weights: the pipeline's, else the model's own."""
        dtypes = {p.dtype for p in self.params.values()}
        return self.runtime.dtype or (dtypes.pop() if len(dtypes) == 1 else None)

    def take(self, tier: str, *, unit_name: str | None = None, layer: int | None = None, quant=None):
        """Hand the parameters to the store as one unit; they become placeholders. Parameters
        another binding took already (tied weights) share its unit instead."""
        if self.taken_by_another() is not None:
            return self.unit
        store = self.runtime.store
        self.unit = store.add(unit_name or self.prefix, self.sources(), tier, layer=layer,
                              dtype=self.dtype, quant=quant, every_step=True)
        self.stand_in(None if store.offloaded(self.unit) else store.own_tensors(self.unit))
        self.runtime.store.tie(self.tie_key(), [self.unit], self)
        return self.unit

    def stand_in(self, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Point every parameter at ``tensors[name]`` (default: a storage-less placeholder),
        keeping what it held for :meth:`restore`. Meta parameters (from_pretrained) are
        replaced by new Parameter objects, since ``.data`` of a meta tensor cannot change device."""
        device = self.runtime.device
        self.bound_to = None
        for n, p in self.params.items():
            ph = tensors[n] if tensors is not None else placeholder(p, device)
            self.placeholders[n] = ph
            if p.is_meta:
                owner, leaf = _owner(self.module, n)
                self.originals[n] = p
                # requires_grad as transformers made it (kinject.io.loading.materialise_rest: why)
                new = nn.Parameter(ph, requires_grad=p.requires_grad and ph.is_floating_point())
                owner._parameters[leaf] = new
                self.params[n] = new
            else:
                self.saved[n] = p.data
                p.data = ph

    def restore(self) -> None:
        """Exact inverse of :meth:`stand_in`: the same Parameter objects and tensors as before."""
        self.bound_to = None
        for n, data in self.saved.items():
            self.params[n].data = data
        for n, orig in self.originals.items():
            owner, leaf = _owner(self.module, n)
            owner._parameters[leaf] = orig
            self.params[n] = orig
        self.saved.clear()
        self.originals.clear()
        self.leader = None
        self.roles = {n: n for n in self.names}

    def give_back(self) -> None:
        """Exact inverse of :meth:`take`."""
        self.restore()
        if self.unit is not None and self.unit.name in self.runtime.store:
            self.runtime.store.remove(self.unit)
        self.unit = None

    def in_use(self) -> "_InUse":
        """The module's weights on the device for the block: acquire through the scheduler
        (waiting on its transfer), bind; then unbind and release, also on error.

        When what was acquired *is* the unit's own tensors (a resident unit, or a host unit used
        in place on a CPU device), the parameters stay bound after the block: they hold no
        memory of their own, and the next use finds them bound (no ``.data`` swaps per call).
        A unit bound already to tensors that need no acquire, wait or release (a resident unit, or a
        host unit a CPU uses in place: ``TensorStore.resident_tensors``): the block is :data:`_BOUND`,
        which does nothing (asked per module per step: the attention and routers a chat keeps on the
        device, every module of a model whose weights a CPU uses in place)."""
        bound = self.bound_to
        if bound is not None and bound is self.runtime.store.resident_tensors(self.unit):
            return _BOUND
        return _InUse(self)

    def prefetch_units(self) -> list:
        """The unit, if it is offloaded (what the scheduler prefetches ahead of its operator)."""
        return [self.unit] if self.offloaded else []

    def settled(self) -> bool:
        """Nothing to prefetch: the unit is resident, materialised, on its way, or never moves
        (host tensors a CPU uses in place: ``TensorStore.never_moves``), or there is none."""
        return self.unit is None or self.runtime.store.settled(self.unit)

    @property
    def offloaded(self) -> bool:
        return self.unit is not None and self.runtime.store.offloaded(self.unit)

    def bind(self, tensors: dict[str, torch.Tensor]) -> None:
        roles = self.roles
        for n, p in self.params.items():
            p.data = tensors[roles[n]]
        self.bound_to = tensors

    def unbind(self) -> None:
        for n, p in self.params.items():
            p.data = self.placeholders[n]
        self.bound_to = None


class _InUse:
    """:meth:`ParamBinding.in_use` (a class, not a generator: entered once per module call)."""

    __slots__ = ("binding", "tensors")

    def __init__(self, binding: ParamBinding):
        self.binding = binding
        self.tensors = None

    def __enter__(self) -> None:
        b = self.binding
        self.tensors = tensors = b.runtime.scheduler.acquire(b.unit)
        if tensors is not b.bound_to:
            try:
                b.bind(tensors)
            except BaseException:
                b.unbind()
                b.runtime.scheduler.release(b.unit)
                raise

    def __exit__(self, *exc) -> None:
        b, tensors = self.binding, self.tensors
        unit, rt = b.unit, b.runtime
        if not rt.store.stays_bound(unit, tensors):
            b.unbind()
        rt.scheduler.release(unit)


class _Bound:
    """:meth:`ParamBinding.in_use` of a resident unit already bound: nothing to do on either side."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_BOUND = _Bound()


def _owner(module: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, leaf = dotted.split(".")
    for part in path:
        module = getattr(module, part)
    return module, leaf


class Default(Operator):
    """KTransformers' ``default``: keep the module and its math, only set its device.

    Rule alias: ``replace: {class: default, kwargs: {device: cuda:0}}``. Without ``device``
    the pipeline's compute device is used.
    """

    def __init__(self, base: nn.Module, *, key: str, runtime: "Runtime", device: str | None = None):
        super().__init__(base, key=key, runtime=runtime)
        self.target = torch.device(device) if device is not None else runtime.device
        self._saved: dict[str, torch.Tensor] = {}

    def attach(self) -> None:
        """Move materialised tensors to the target. Meta ones (a model built by
        ``kinject.from_pretrained``) have no data to move: the loader reads them onto
        :meth:`load_device` after every operator is attached."""
        for name, t in _tensors(self.base):
            if t.device != self.target and not t.is_meta:
                self._saved[name] = t.data
                t.data = t.data.to(self.target)
        super().attach()

    def load_device(self) -> torch.device:
        return self.target

    def detach(self) -> nn.Module:
        tensors = dict(_tensors(self.base))
        for name, data in self._saved.items():
            tensors[name].data = data
        self._saved.clear()
        return super().detach()


def _tensors(module: nn.Module):
    """Parameters and buffers of a module, with their dotted names (shared ones once)."""
    yield from module.named_parameters()
    yield from module.named_buffers()


def placeholder(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A storage-less stand-in with ``like``'s shape and dtype (one shared scalar, expanded).

    Offloaded parameters point at this between uses, so HF code that reads ``.shape`` or
    ``.dtype`` keeps working while the real bytes live in the store. (``.data = meta``
    is not allowed for a materialised parameter, hence a real-device scalar.)
    """
    return torch.zeros((), dtype=like.dtype, device=device).expand(like.shape)
