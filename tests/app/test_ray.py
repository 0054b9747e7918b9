"""``kinject run --ray`` on a local Ray instance (2 CPUs, 2 actors, the built-in model): the same
greedy results as the single-process job, resume after an interrupted run, bad inputs as one
line with nothing written lost. Ray starts once for the module."""

import json
import shutil

import pytest

from kinject.app.run import RunConfig, run_job
from kinject.app.scale import run_ray_job
from kinject.errors import KinjectError
from kinject.fixtures import tiny_moe_path

ray = pytest.importorskip("ray")

NEW = 4
PROMPTS = [f"def function_{i}(x):\n    return" if i % 2 else f"# note {i}: the experts" for i in range(24)]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


@pytest.fixture(scope="module")
def reference(prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "out.jsonl"
    run_job(RunConfig(prompts=str(prompts_file), out=str(out), max_new_tokens=NEW, progress=False))
    return by_id(out)


def by_id(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def ray_cfg(prompts, out, **kw):
    return RunConfig(prompts=str(prompts), out=str(out), max_new_tokens=NEW, progress=False, **kw)


def test_two_actors_give_the_single_process_results(prompts_file, reference, tmp_path):
    out = tmp_path / "ray.jsonl"
    summary = run_ray_job(ray_cfg(prompts_file, out), actors=2)
    assert by_id(out) == reference                                   # ids, completions, token ids
    assert summary["stats"].groups == 3 and summary["done_total"] == 24
    assert sorted(a["groups"] for a in summary["per_actor"].values()) == [1, 2]    # both actors worked
    assert summary["bytes_moved"]["host"] > 0

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": [f"p{i}" for i in range(len(PROMPTS))], "prompt": PROMPTS})
    pq.write_table(table, tmp_path / "prompts.parquet")
    run_ray_job(ray_cfg(tmp_path / "prompts.parquet", tmp_path / "pq.jsonl"), actors=2)
    assert by_id(tmp_path / "pq.jsonl") == reference


def test_resume_after_an_interrupted_run_redoes_only_the_missing_groups(prompts_file, reference, tmp_path):
    out = tmp_path / "ray.jsonl"
    run_ray_job(ray_cfg(prompts_file, out), actors=2)
    lines = out.read_text().splitlines(keepends=True)
    first_group = [ln for ln in lines if json.loads(ln)["id"] in {f"p{i}" for i in range(8)}]
    out.write_text("".join(first_group) + lines[-1][:20])           # killed: one group kept, a torn write
    summary = run_ray_job(ray_cfg(prompts_file, out), actors=2)
    assert summary["skipped"] == 8 and summary["stats"].prompts == 16
    assert by_id(out) == reference
    assert run_ray_job(ray_cfg(prompts_file, out), actors=2)["stats"].groups == 0   # nothing left to do


def test_bad_inputs_are_one_line_and_lose_nothing(prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    with pytest.raises(KinjectError, match="prompts file not found"):
        run_ray_job(ray_cfg(tmp_path / "nope.jsonl", out))
    assert not out.exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b"}\n{"id": 3, "prompt": \n')
    with pytest.raises(KinjectError, match=r"bad.jsonl:3: malformed JSON line"):
        run_ray_job(ray_cfg(bad, out))
    assert not out.exists()

    broken = tmp_path / "model"                                      # config and tokenizer, no weights
    shutil.copytree(tiny_moe_path(), broken, ignore=shutil.ignore_patterns("*.safetensors"))
    out.write_text('{"id": "kept", "completion": "from an earlier run"}\n')
    with pytest.raises(KinjectError) as ei:
        run_ray_job(ray_cfg(prompts_file, out, model=str(broken)), actors=1)
    msg = str(ei.value)
    assert "kinject actor could not build its model" in msg and "\n" not in msg
    assert out.read_text() == '{"id": "kept", "completion": "from an earlier run"}\n'
