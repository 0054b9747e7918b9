"""Klotski's planner (§7, eqs. 4-7) and the HRM roofline bound (MoE-Lightning §3) on hand-computed profiles."""

import math

import pytest

from kinject.errors import KinjectError, PlanError
from kinject.plan.planner import (AUTO_TOLERANCE, Constraints, ExpertCost, Profile, best_n, experts_moved,
                             format_table, inequality_rows, memory_usage, predict_step, roofline_bound, solve,
                             throughput_n)

MiB, GiB = 1 << 20, 1 << 30
ms = 1e-3


def _profile(**over):
    """Synthetic layer: t_cA = 2 ms, t_cG = 0.5 ms per micro-batch of bs = 4 (decode),
    t_cE(x tokens) = 1 ms + 0.01 ms * x, t_IO_G = 1 ms, t_IO_E = 10 ms, t_IO_A = 8 ms,
    E = 8 experts, top-2, 4 layers."""
    kw = dict(bs=4, t_attn=2 * ms, t_gate=0.5 * ms, t_expert=ExpertCost(1 * ms, 0.01 * ms), num_experts=8,
              top_k=2, num_layers=4, t_load_attn=8 * ms, t_load_gate=1 * ms, t_load_expert=10 * ms,
              attn_bytes=64 * MiB, gate_bytes=1 * MiB, expert_bytes=32 * MiB, device="synthetic",
              model="toy-moe")
    kw.update(over)
    return Profile(**kw)


# Hand computation, K = 2, h = hot_coverage = 0.5, len(Q) = 6 (given), N = n*bs = 4n tokens, k = 2:
#   t_c_hotE    = K*a + b*h*N*k     = 2*1 + 0.01*0.5*4n*2 = 2 + 0.04n  ms
#   sum_Q t_cEi = 6*a + b*(1-h)*N*k = 6 + 0.04n                        ms
#   (4) 2n                 >= 1                 -> n >= 0.5    -> 1
#   (5) 2.5n               >= 1 + 2*10 = 21     -> n >= 8.4    -> 9
#   (6) 2.5n + 2 + 0.04n   >= 1 + 3*10 = 31     -> n >= 11.42  -> 12
#   (7) 2.58n + 8          >= 1 + 8*10 + 8 = 89 -> n >= 31.40  -> 32      => n = 32, (7) binds
def test_solve_hand_computed():
    plan = solve(_profile(), bs=4, hot_coverage=0.5, cold_experts=6)
    assert plan.n == 32
    assert plan.binding_row.startswith("(7)")
    assert all(r.holds for r in plan.rows)
    r4, r5, r6, r7 = plan.rows
    assert r4.lhs == pytest.approx(64 * ms) and r4.rhs == pytest.approx(1 * ms)
    assert r5.lhs == pytest.approx(80 * ms) and r5.rhs == pytest.approx(21 * ms)
    assert r6.lhs == pytest.approx((80 + 2 + 1.28) * ms) and r6.rhs == pytest.approx(31 * ms)
    assert r7.lhs == pytest.approx((2.58 * 32 + 8) * ms) and r7.rhs == pytest.approx(89 * ms)
    below = inequality_rows(_profile(), 31, 4, 0.5, cold_experts=6)
    assert [r.holds for r in below] == [True, True, True, False]      # 2.58*31 + 8 = 87.98 < 89
    # per-row minimum n matches the hand numbers
    for eq, n_min in ((4, 1), (5, 9), (6, 12), (7, 32)):
        assert not n_min > 1 or not inequality_rows(_profile(), n_min - 1, 4, 0.5, cold_experts=6)[eq - 4].holds
        assert inequality_rows(_profile(), n_min, 4, 0.5, cold_experts=6)[eq - 4].holds


# Faster link, t_IO_E = 2 ms, t_IO_A = 4 ms, same compute, K = 2, h = 0.75, len(Q) = 3:
#   (5) 2.5n               >= 1 + 4 = 5          -> n >= 2      -> 2
#   (6) 2.5n + 2 + 0.06n   >= 1 + 6 = 7          -> n >= 1.95   -> 2
#   (7) 2.5n + (2 + 0.06n) + (3 + 0.02n) = 2.58n + 5 >= 1 + 5*2 + 4 = 15 -> n >= 3.88 -> 4
def test_solve_second_hand_example():
    p = _profile(t_load_expert=2 * ms, t_load_attn=4 * ms)
    plan = solve(p, bs=4, hot_coverage=0.75, cold_experts=3)
    assert plan.n == 4 and plan.binding_row.startswith("(7)")
    assert plan.rows[3].lhs == pytest.approx((2.58 * 4 + 5) * ms)


def test_all_tokens_on_hot_experts_makes_eq6_vacuous():
    # h = 1 -> no cold expert: (6) is vacuous, (7) = 2.5n + 2 + 0.08n >= 1 + 20 + 8 = 29 -> n >= 10.47 -> 11
    plan = solve(_profile(), bs=4, hot_coverage=1.0)
    assert plan.cold_experts == 0 and plan.n == 11
    assert plan.rows[2].holds and "vacuous" in plan.rows[2].note


def test_default_cold_expert_estimate_uses_uniform_routing():
    # n = 1: N = 4 tokens, m = (1 - 0.5) * 4 * 2 = 4 cold assignments over E-K = 6 experts
    q = 6 * (1 - (5 / 6) ** 4)
    r7 = inequality_rows(_profile(), 1, 4, 0.5)[3]
    assert r7.rhs == pytest.approx((1 + (2 + q) * 10 + 8) * ms)
    # more micro-batches activate more cold experts, up to all E-K of them
    assert solve(_profile(), bs=4, hot_coverage=0.5).cold_experts == pytest.approx(6, abs=1e-3)


def test_infeasible_transfer_too_slow_names_the_row():
    # t_IO_E = 1 s: (5) needs 2.5n ms >= 1 + 2000 ms -> n >= 800.4; at n_max = 64: 160 ms vs 2001 ms
    with pytest.raises(PlanError) as exc:
        solve(_profile(t_load_expert=1.0), bs=4, hot_coverage=0.5, cold_experts=6, n_max=64)
    msg = str(exc.value)
    assert "(5) hot experts ready" in msg and "(7) next attention ready" in msg
    assert "160.000 ms < transfer side 2.001 s, short by 1.841 s" in msg
    assert "would need n >= 800.4" in msg


def test_infeasible_memory_names_budget_and_shortfall():
    # device peak at n = 32 (the bubble-free n above), kv 4 MiB/seq over 4 layers, 256 KiB activations/seq:
    #   resident 512 + weights (64 + 1 + min(8, 2+6)*32 = 321) + KV (2+2)*4*4/4 = 16 + act 32*4*0.25 = 32  = 881 MiB
    #   (KV: micro-batch k computing, k+1 loading, the STORES_IN_FLIGHT = 2 before it storing)
    c = Constraints(device_budget=860 * MiB, resident_bytes=512 * MiB, kv_bytes_per_seq=4 * MiB,
                    activation_bytes_per_seq=256 * 1024)
    m = memory_usage(_profile(), c, 32, cold_experts_q=6)
    assert m["device_peak"] == 881 * MiB and m["device_kv"] == 16 * MiB
    with pytest.raises(PlanError) as exc:
        solve(_profile(), c, bs=4, hot_coverage=0.5, cold_experts=6)
    msg = str(exc.value)
    assert "device memory: needs 881.00 MiB at n=32, budget 860.00 MiB, short by 21.00 MiB" in msg
    assert "smallest bubble-free n is 32" in msg and "n=11 fits" in msg
    # strict=False: the largest n that fits (849 + n MiB <= 860 -> n = 11), flagged as not bubble-free
    plan = solve(_profile(), c, bs=4, hot_coverage=0.5, cold_experts=6, strict=False)
    assert plan.n == 11 and not plan.bubble_free and plan.memory["device_peak"] == 860 * MiB
    assert not plan.rows[3].holds and "memory caps n" in format_table(plan)
    # a budget that fits
    ok = solve(_profile(), Constraints(**{**c.__dict__, "device_budget": 900 * MiB}), bs=4, hot_coverage=0.5,
               cold_experts=6)
    assert ok.n == 32 and ok.memory["device_peak"] == 881 * MiB


def test_infeasible_host_memory():
    # host at n = 32: 10 GiB weights + KV 32*4*4 MiB = 512 MiB + activations 32 MiB -> short by 544 MiB
    c = Constraints(host_budget=10 * GiB, host_resident_bytes=10 * GiB, kv_bytes_per_seq=4 * MiB,
                    activation_bytes_per_seq=256 * 1024)
    with pytest.raises(PlanError, match=r"host memory: needs 10\.53 GiB at n=32, budget 10\.00 GiB, "
                                        r"short by 544\.00 MiB"):
        solve(_profile(), c, bs=4, hot_coverage=0.5, cold_experts=6)


def test_roofline_bound_hand_example():
    # 1 GB over 25 GB/s = 40 ms; 1 TFLOP at 100 TFLOP/s = 10 ms -> 64 tokens / 40 ms = 1600 tokens/s
    b = roofline_bound(tokens_per_step=64, bytes_per_step=1e9, bandwidth=25e9, flops_per_step=1e12,
                       peak_flops=100e12)
    assert b.binding == "transfer" and float(b) == pytest.approx(1600)
    assert b.terms["compute"] == pytest.approx(0.01)
    # 8 TFLOP -> 80 ms > 40 ms: compute-bound, 800 tokens/s
    b = roofline_bound(tokens_per_step=64, bytes_per_step=1e9, bandwidth=25e9, flops_per_step=8e12,
                       peak_flops=100e12)
    assert b.binding == "compute" and b.tokens_per_s == pytest.approx(800)
    # GPU memory roof (HRM eq. 14): 0.5 TB at 2 TB/s = 250 ms binds -> 64 / 0.25 = 256 tokens/s
    b = roofline_bound(tokens_per_step=64, bytes_per_step=1e9, bandwidth=25e9, flops_per_step=1e12,
                       peak_flops=100e12, device_bytes_per_step=0.5e12, device_bandwidth=2e12)
    assert b.binding == "device-memory" and b.tokens_per_s == pytest.approx(256)
    with pytest.raises(KinjectError):
        roofline_bound(tokens_per_step=64, bytes_per_step=1e9)


def test_plan_bound_counts_transfers_and_compute():
    # n = 32, 4 layers: transfer 4*(8 + 1 + 8*10) = 356 ms; compute 4*(2.58*32 + 8) = 362.24 ms -> compute-bound
    plan = solve(_profile(), bs=4, hot_coverage=0.5, cold_experts=6)
    assert plan.bound.binding == "compute"
    assert plan.bound_tokens_per_s == pytest.approx(128 / 0.36224)


def test_format_table_has_every_row_and_neighbours():
    plan = solve(_profile(), bs=4, hot_coverage=0.5, cold_experts=6)
    text = format_table(plan)
    for r in plan.rows:
        assert r.name in text and r.formula in text
    assert "n=31" in text and "n=32 (chosen)" in text and "n=33" in text
    assert "✓" in text and "✗" in text                   # (7) fails at n = 31
    assert "roofline bound" in text and "device memory" in text


def test_profile_json_round_trip_and_derived_transfer_times(tmp_path):
    p = Profile(bs=8, t_attn=1 * ms, t_gate=0.1 * ms, t_expert=(0.5 * ms, 0.002 * ms), num_experts=8, top_k=2,
                num_layers=32, attn_bytes=100 * MiB, gate_bytes=1 * MiB, expert_bytes=336 * MiB,
                kv_bytes=8 * MiB, bandwidth=25e9, dtype="bfloat16", quant="", device="RTX 3090",
                model="Mixtral-8x7B", meta={"note": "what-if"})
    assert p.t_load_expert == pytest.approx(336 * MiB / 25e9)
    assert p.t_store_kv == pytest.approx(8 * MiB / 25e9)
    p.save(tmp_path / "p.json")
    q = Profile.load(tmp_path / "p.json")
    assert q == p and q.cache_key() == p.cache_key()
    assert Profile.from_json(p.to_json()).t_expert == ExpertCost(0.5 * ms, 0.002 * ms)
    with pytest.raises(KinjectError, match="no bandwidth"):
        Profile(bs=1, t_attn=0, t_gate=0, t_expert=(0, 0), num_experts=2, top_k=1, num_layers=1, expert_bytes=10)
    with pytest.raises(KinjectError, match="measured at micro-batch size bs=8"):
        solve(p, bs=16)
    fit = ExpertCost.fit([1, 2, 3], [3.0, 5.0, 7.0])
    assert math.isclose(fit.fixed_s, 1.0) and math.isclose(fit.per_token_s, 2.0) and fit(0) == 0


def test_link_bandwidth_is_bytes_over_the_links_busy_time():
    """Transfers queued behind each other on one link overlap in the trace: the link's rate is
    their bytes over the union of their spans, not over the sum (which counts the queueing)."""
    from types import SimpleNamespace

    from kinject.plan.profiler import link_bandwidth
    from kinject.trace import TraceEvent

    def transfer(stream, start, end, nbytes):
        return TraceEvent(stream, "u", start, end, kind="transfer", nbytes=nbytes)

    events = [transfer("prefetch", 0.0, 1.0, 100), transfer("ondemand", 0.5, 2.0, 100),   # busy 0..2
              transfer("kv_load", 3.0, 4.0, 100),                                          # busy 3..4
              transfer("kv_store", 0.0, 10.0, 10**6),                                      # the other direction
              TraceEvent("compute", "op", 0.0, 5.0)]
    real = SimpleNamespace(emulate_bandwidth=None)
    assert link_bandwidth(events, real) == pytest.approx(300 / 3.0)
    assert link_bandwidth([], real) is None
    emulated = SimpleNamespace(emulate_bandwidth=4.0)        # GB/s: exactly its configured rate
    assert link_bandwidth(events, emulated) == 4e9


def test_best_n_is_the_highest_bound_that_fits_and_micro_batch_prefill_frees_it():
    # a step moves the layer's weights whatever n (every expert, once the group's tokens reach them), so
    # the bound's tokens/s grows with n; device memory from n = 3 on (all 8 experts of 32 MiB landed):
    # 64 + 1 + 256 MiB of weights + 4 MiB x bs=4 x n of activations (group prefill), 16 MiB at any n
    # with one micro-batch's prefill at a time
    p = _profile(bandwidth=1e9)
    group = Constraints(device_budget=(64 + 1 + 256 + 16 * 6) * MiB, activation_bytes_per_seq=4 * MiB)
    n_group, b_group = best_n(p, group, n_max=16, hot_coverage=0.0)
    assert n_group == 6                                  # 7 x bs=4 sequences' activations would not fit
    micro = Constraints(device_budget=group.device_budget, activation_bytes_per_seq=4 * MiB,
                        prefill_by_micro_batch=True, group_bytes_per_seq=1024)
    assert memory_usage(p, micro, 16)["device_activations"] == 4 * 4 * MiB       # one micro-batch's prefill
    n_micro, b_micro = best_n(p, micro, n_max=16, hot_coverage=0.0)
    assert n_micro == 16 and b_micro.tokens_per_s > b_group.tokens_per_s
    with pytest.raises(PlanError, match="no n fits the device budget"):
        best_n(p, Constraints(device_budget=1 * MiB), n_max=4)


def test_predict_step_counts_what_the_engine_moves_and_its_untraced_work():
    # E = 8, top-2, bs = 4: one micro-batch's 4 tokens use an expert with P = 1 - (3/4)^4 = 0.684
    p = _profile(bandwidth=1e9, extra_compute_s=5 * ms,
                 meta={"kv_bytes_per_token_layer": 1000.0, "untraced_per_micro_batch_s": 1 * ms})
    used = 1 - 0.75 ** 4
    assert experts_moved(p, 1) == pytest.approx(2 + 6 * used)              # K hot + the cold ones used
    assert experts_moved(p, 1, hot_probability=0.5) == 8                  # P >= 0.5: all prefetched
    assert experts_moved(p, 1, hot_probability=0.7) == pytest.approx(2 + 6 * used)
    got = predict_step(p, 2, context=100, hot_coverage=0.5, hot_probability=0.5)
    kv = 2 * 4 * 100 * 1000 / 1e9                                          # every micro-batch's KV, per layer
    transfer = 8 * ms + 1 * ms + 8 * 10 * ms + kv
    compute = inequality_rows(p, 2, hot_coverage=0.5)[-1].lhs - 0.5 * ms     # one gate call routes both micro-batches
    assert transfer > compute and got["kv_s"] == pytest.approx(4 * kv)
    assert got["step_s"] == pytest.approx(4 * transfer + 5 * ms + 1 * ms)  # link-bound layers + untraced work
    assert got["compute_s"] == pytest.approx(4 * compute) and got["extra_s"] == pytest.approx(6 * ms)


def test_predict_step_adds_the_wait_for_a_layers_weights_burst():
    # a fast link: t_IO_A = 1 ms, t_IO_G = 0.1 ms, t_IO_E = 0.5 ms; 1000 B of KV per token: one micro-batch's
    # KV at context 100 = 4 x 100 x 1000 B / 1 GB/s = 0.4 ms; measured overlap 2 ms
    p = _profile(bandwidth=1e9, t_load_attn=1 * ms, t_load_gate=0.1 * ms, t_load_expert=0.5 * ms,
                 extra_compute_s=5 * ms, meta={"kv_bytes_per_token_layer": 1000.0, "untraced_per_micro_batch_s": 1 * ms,
                                               "link_overlap_s": 2 * ms, "hot_probability": 0.5})
    got = predict_step(p, 4, context=100, hot_coverage=0.5)     # 16 tokens use every expert: all 8 move
    compute = inequality_rows(p, 4, hot_coverage=0.5)[-1].lhs - 3 * 0.5 * ms     # one gate call for the group
    weights = 1 * ms + 0.1 * ms + 8 * 0.5 * ms                     # 5.1 ms: one burst per layer
    stall = weights + 0.4 * ms - 2 * ms                            # 3.5 ms: the next micro-batch's KV behind it
    assert got["experts_moved"] == 8 and compute + stall > weights + 4 * 0.4 * ms      # compute-bound layers
    assert got["stall_s"] == pytest.approx(4 * stall) and got["transfer_s"] == pytest.approx(4 * (weights + 1.6 * ms))
    assert got["extra_s"] == pytest.approx(5 * ms + 3 * 1 * ms)
    assert got["step_s"] == pytest.approx(4 * (compute + stall) + 8 * ms)
    p.meta["link_overlap_s"] = 1.0                                 # the compute hides the burst: no wait
    assert predict_step(p, 4, context=100, hot_coverage=0.5)["step_s"] == pytest.approx(4 * compute + 8 * ms)
    slow = _profile(bandwidth=1e9, meta={"link_overlap_s": 2 * ms, "hot_probability": 0.5})   # t_IO_E = 10 ms
    got = predict_step(slow, 4, context=100, hot_coverage=0.5)     # the burst (89 ms) outlasts the compute:
    assert got["step_s"] == pytest.approx(4 * (compute + 89 * ms - 2 * ms))      # only the overlap hides in it
    assert predict_step(slow, 4, context=100, hot_coverage=0.5, hot_probability=None)["step_s"] == got["step_s"]
    del slow.meta["link_overlap_s"]                                # a hand-made profile: max(compute, link)
    assert predict_step(slow, 4, context=100, hot_coverage=0.5)["step_s"] == pytest.approx(4 * 89 * ms)


def _lanes_profile(**over):
    """_profile with a fast link (t_IO_A = 1 ms, t_IO_G = 0.1 ms, t_IO_E = 0.5 ms, 1000 B of KV per token) and
    every step term the profiler measures: attention over the group 3 ms + 1.5 ms per further micro-batch,
    untraced work 5 ms + 1 ms per further micro-batch of which 2 ms + 0.25 ms at the step boundary, the
    thread's work beside a layer's weights 2 ms, every expert a group of >= 50 % use prefetched."""
    meta = {"kv_bytes_per_token_layer": 1000.0, "untraced_per_micro_batch_s": 1 * ms, "untraced_boundary_s": 2 * ms,
            "untraced_boundary_per_micro_batch_s": 0.25 * ms, "attn_first_s": 3 * ms, "attn_per_micro_batch_s": 1.5 * ms,
            "link_overlap_s": 2 * ms, "hot_probability": 0.5}
    kw = dict(bandwidth=1e9, t_load_attn=1 * ms, t_load_gate=0.1 * ms, t_load_expert=0.5 * ms, extra_compute_s=5 * ms,
              meta=meta)
    kw.update(over)
    return _profile(**kw)


def test_predict_step_charges_each_term_on_its_lane():
    # n = 4, bs = 4: N = 16 tokens, K = 2 hot experts at h = 0.5 (16 assignments), 16 cold ones over 6 experts
    p = _lanes_profile()
    q = 6 * (1 - (5 / 6) ** 16)                                     # len(Q): cold experts the group uses
    experts = (2 * 1 + 0.01 * 16) * ms + (q * 1 + 0.01 * 16) * ms   # K*a + b*h*N*k, len(Q)*a + b*(1-h)*N*k
    compute = (3 + 3 * 1.5) * ms + 0.5 * ms + experts               # attention line, ONE gate call, experts
    inside = ((5 + 3 * 1) - (2 + 3 * 0.25)) * ms / 4                # untraced work inside the layers, per layer
    weights, kv_one = (1 + 0.1 + 8 * 0.5) * ms, 4 * 100 * 1000 / 1e9    # all 8 experts move; one micro-batch's KV
    stall = weights + kv_one - 2 * ms                               # 3.5 ms: the next KV queues behind the burst
    got = predict_step(p, 4, context=100, hot_coverage=0.5)
    assert got["compute_s"] == pytest.approx(4 * compute)
    assert got["transfer_s"] == pytest.approx(4 * (weights + 4 * kv_one))
    assert got["extra_s"] == pytest.approx(8 * ms) and got["boundary_s"] == pytest.approx(2.75 * ms)
    assert compute + inside + stall > weights + 4 * kv_one          # the thread's lane binds
    assert got["step_s"] == pytest.approx(4 * (compute + inside + stall) + 2.75 * ms)
    assert got["step_s"] == pytest.approx(got["compute_s"] + got["stall_s"] + got["extra_s"])
    # a slow link (t_IO_E = 10 ms) and no measured overlap: the link's lane binds, and the untraced work
    # inside the layers runs while the weights are in flight: only the boundary's adds to the link
    slow = _lanes_profile(t_load_expert=10 * ms)
    del slow.meta["link_overlap_s"]
    link = (1 + 0.1 + 80) * ms + 4 * kv_one
    got = predict_step(slow, 4, context=100, hot_coverage=0.5)
    assert link > compute + inside and got["step_s"] == pytest.approx(4 * link + 2.75 * ms)
    assert got["stall_s"] == pytest.approx(4 * (link - compute - inside))
    # a hand-made profile (no attention line, no boundary term): n*t_cA, every untraced second at the boundary
    plain = _profile(bandwidth=1e9, extra_compute_s=5 * ms, meta={"untraced_per_micro_batch_s": 1 * ms})
    got = predict_step(plain, 4, context=0, hot_coverage=0.5)
    assert got["compute_s"] == pytest.approx(4 * (4 * 2 * ms + 0.5 * ms + experts))
    assert got["step_s"] == pytest.approx(got["transfer_s"] + 8 * ms)


def test_throughput_n_picks_within_what_the_model_resolves():
    # the lanes profile is thread-bound from n = 1 on: every further micro-batch adds 1.5 ms of attention,
    # 0.75 ms of untraced work and its experts' rows, against the step's fixed costs it shares
    p = _lanes_profile()
    rate = {n: n * 4 / predict_step(p, n, context=100, hot_coverage=0.5)["step_s"] for n in range(1, 17)}
    best = max(rate.values())
    assert AUTO_TOLERANCE == 0.02
    n = throughput_n(p, n_max=16, context=100, hot_coverage=0.5)
    assert n == min(m for m, r in rate.items() if r >= 0.98 * best)
    assert throughput_n(p, n_max=16, context=100, hot_coverage=0.5, tolerance=0.05) < n


def test_throughput_n_is_the_smallest_n_near_the_best_predicted_rate():
    p = _profile(bandwidth=1e9, extra_compute_s=40 * ms, meta={"untraced_per_micro_batch_s": 1 * ms})
    rate = {n: n * 4 / predict_step(p, n, context=0, hot_coverage=0.5)["step_s"] for n in range(1, 17)}
    best = max(rate.values())
    assert throughput_n(p, n_max=16, context=0, hot_coverage=0.5, tolerance=0.0) == max(rate, key=rate.get)
    n = throughput_n(p, n_max=16, context=0, hot_coverage=0.5, tolerance=0.1)
    assert rate[n] >= 0.9 * best and all(rate[m] < 0.9 * best for m in range(1, n))
    fits3 = memory_usage(p, Constraints(activation_bytes_per_seq=MiB), 3, hot_k=2, cold_experts_q=6)["device_peak"]
    capped = Constraints(device_budget=fits3, activation_bytes_per_seq=MiB)
    assert throughput_n(p, capped, n_max=16, context=0, hot_coverage=0.5, tolerance=0.0) <= 3
    with pytest.raises(PlanError, match="no n <= 16 fits"):
        throughput_n(p, Constraints(device_budget=1), n_max=16, context=0)
    with pytest.raises(KinjectError, match="tolerance"):
        throughput_n(p, n_max=16, context=0, tolerance=1.0)
