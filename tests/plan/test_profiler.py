"""Profiler: a Profile measured from a calibration run's trace, cached; `kinject plan`."""

import pytest

import kinject
from kinject.plan import planner, profiler
from kinject.errors import PlanError
from kinject.testing import build_tiny_model


@pytest.fixture()
def model(tmp_path):
    m = build_tiny_model("mixtral")
    kinject.optimize(m, "rules/mixtral_klotski.yaml", ["pipeline.emulate_bandwidth=0.05",
                                                       f"pipeline.offload_dir={tmp_path}"])
    yield m
    kinject.restore(m)


def test_profile_is_measured_from_the_trace_and_cached(model, monkeypatch):
    prof = profiler.measure_profile(model, bs=2)
    assert prof.num_experts == 8 and prof.top_k == 2 and prof.num_layers == 2 and prof.bs == 2
    assert prof.t_attn > 0 and prof.t_gate > 0 and prof.t_expert.per_token_s >= 0
    # the untraced work between two steps' layers is a part of the step's untraced work
    assert 0 <= prof.meta["untraced_boundary_s"] <= prof.extra_compute_s
    step = planner.predict_step(prof, 2, context=12)
    assert step["step_s"] == pytest.approx(step["compute_s"] + step["stall_s"] + step["extra_s"])
    unit = model.kinject.store["model.layers.0.mlp.experts[0]"]
    assert prof.expert_bytes == unit.wire_nbytes
    assert prof.meta["emulated_link"] is True
    # the emulated link is 0.05 GB/s: measured bandwidth cannot beat it
    assert prof.bandwidth <= 0.05e9 * 1.05
    assert prof.t_load_expert == pytest.approx(prof.expert_bytes / prof.bandwidth)
    path = profiler.profile_cache_path(model, 2, 8)
    assert path.is_file()
    monkeypatch.setattr(profiler, "_calibration_events", lambda *a, **k: pytest.fail("re-profiled"))
    assert profiler.measure_profile(model, bs=2) == prof            # served from the cache
    plan = planner.solve(prof, planner.Constraints(), bs=2, n_max=256, strict=False)
    assert plan.n >= 1 and len(plan.rows) == 4


def test_profile_needs_per_expert_operators(tmp_path):
    m = build_tiny_model("mixtral")
    kinject.optimize(m, "rules/mixtral_offload.yaml", [f"pipeline.offload_dir={tmp_path}"])
    with pytest.raises(PlanError, match="GroupedExperts"):
        profiler.measure_profile(m, bs=2)


def test_plan_cli_prints_the_table_and_yaml_line(tmp_path, capsys):
    from kinject.app.cli import main
    from kinject.testing import save_tiny_model

    path = save_tiny_model("mixtral", tmp_path / "m")
    assert main(["plan", str(path), "rules/mixtral_klotski.yaml", "--set", "pipeline.emulate_bandwidth=0.05",
                 "--set", f"pipeline.offload_dir={tmp_path}/o", "--n-max", "256"]) == 0
    out = capsys.readouterr().out
    for row in ("(4)", "(5)", "(6)", "(7)", "roofline bound", "pipeline: {n_batches:", "EMULATED"):
        assert row in out
