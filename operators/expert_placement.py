"""Which compute site each expert of a step uses: :class:`ExpertSites`.

An experts operator has one or two compute sites (:class:`~operators.expert_sites.ExpertComputeSite`):
the device's (:class:`~operators.expert_sites.DeviceSide`), always, and the host's
(:class:`~operators.host_experts.HostExperts`) under ``compute: host / auto``. :class:`ExpertSites`
holds both and answers, per expert and per step, which one computes it; the order policy, the
interception and the prefetch planning ask it and never branch on the host side themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from operators.expert_sites import DeviceSide, gemv_groups, weighted_rows
from operators.host_experts import HostExperts

if TYPE_CHECKING:
    from operators.expert_step import ExpertSet

_NONE: frozenset[int] = frozenset()


class ExpertSites:
    """The device's compute site and, under ``compute: host / auto``, the host's (``host``; None under
    ``device``). ``host`` is made now, so ``compute: host`` on a layout no host kernel serves is refused
    at construction, before any module is swapped; ``host_format``: the format host experts compute in
    (:mod:`operators.host_compute`)."""

    def __init__(self, experts: "ExpertSet", compute: str, host_format: str | None = None):
        self.device = DeviceSide(experts, gemv_groups(experts))
        self.host: HostExperts | None = HostExperts.of(experts, compute, self.device, host_format)
        self._cuda = experts.runtime.device.type == "cuda"
        # a decode step's weighted sum of its experts' outputs in one compiled call (None: torch's operations)
        self.weighted_rows = weighted_rows(experts.runtime)

    def on_host(self, counts: list[int]) -> frozenset[int]:
        """The experts (with rows in ``counts``) the host computes this step: none under ``device``."""
        host = self.host
        return _NONE if host is None else host.choose(counts)

    def worth_prefetching(self, experts: list[int], tokens: int | None, top_k: int) -> list[int]:
        """Of the predicted ``experts``, the ones worth moving ahead (all of them under ``device``)."""
        host = self.host
        return experts if host is None else host.worth_prefetching(experts, tokens, top_k)

    def moves_none(self, tokens: int | None) -> bool:
        """Whether no expert can be worth moving ahead (every one off the device computes where it lives)."""
        host = self.host
        return host is not None and host.moves_none(tokens)

    def host_first(self, used: list[int], counts: list[int], run_group: Callable[..., None],
                   start_host: Callable[[list[int]], Callable[[], None]] | None):
        """Compute this step's host experts of ``used`` first, while the device's cold experts are
        still on the link: on a CPU device now, through ``run_group(group, tensors, site)`` with their
        host tensors; on CUDA ``start_host(group)`` starts them on the host worker and returns the
        function that adds their outputs after the device's groups (a call shape without one computes
        them on the device). Returns (the experts left for the device, that function or None)."""
        host = self.host
        group = sorted(host.choose(counts).intersection(used))
        if not group:
            return used, None
        finish = None
        if self._cuda:
            if start_host is None:
                return used, None                 # this call shape computes on the device only
            finish = start_host(group)
        else:
            host.run(group, counts, run_group)
        if len(group) == len(used):               # every expert on the host (a chat's decode step)
            return [], finish
        chosen = set(group)
        return [e for e in used if e not in chosen], finish

    @property
    def device_gemv_groups(self) -> int:
        """Groups the device site computed through kinject's grouped GEMV (a CPU device's decode steps)."""
        gemv = self.device.gemv
        return gemv.groups if gemv is not None else 0

    def reset(self) -> None:
        """The units were (re)made or removed."""
        self.device.reset()
        if self.host is not None:
            self.host.reset()

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
