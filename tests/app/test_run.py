"""`kinject run`: the resumable batch job on the built-in model (CPU, offline).

Output equals plain HF `generate` on the same prompt groups; an interrupted run keeps whole
groups only and a re-run completes it to exactly the uninterrupted file; user errors are one
line on stderr with a non-zero exit; --trace / --plot write what they promise.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.cli_helpers import NEW, cli_without_matplotlib, hf_reference, trimmed
from kinject.app.cli import main
from kinject.rules import PipelineConfig, load_rules
from kinject.app.run import BUILTIN_PROMPTS, RunConfig, default_model_path, done_ids, read_prompts, run_job
from kinject.plan.groups import plan_groups

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """KINJECT_CACHE for the module: the built-in tiny Mixtral is saved there once."""
    path = tmp_path_factory.mktemp("kinject-cache")
    old = os.environ.get("KINJECT_CACHE")
    os.environ["KINJECT_CACHE"] = str(path)
    from kinject.app.run import default_model_path

    model_dir = default_model_path()
    yield model_dir
    if old is None:
        os.environ.pop("KINJECT_CACHE", None)
    else:
        os.environ["KINJECT_CACHE"] = old


def records(path):
    return [json.loads(ln) for ln in Path(path).read_text().splitlines()]


# ------------------------------------------------------------------ end to end


def test_builtin_job_matches_plain_hf_per_group(cache, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert main(["run", "--out", str(out), "--max-new-tokens", str(NEW), "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    assert "klotski.yaml" in text and "n=4 x bs=2" in text and "tokens/s" in text
    assert "bubble fraction" in text and "peak device mem" in text and "prefetch" in text
    got = records(out)
    assert [r["id"] for r in got] == list(range(1, len(BUILTIN_PROMPTS) + 1))
    assert [r["prompt"] for r in got] == list(BUILTIN_PROMPTS)
    group = load_rules(REPO / "rules/mixtral_klotski.yaml").pipeline
    builtin = default_model_path()          # the trained fixture when present, else the tiny random Mixtral
    ref = hf_reference(builtin, list(BUILTIN_PROMPTS), group.n_batches * group.micro_batch_size)
    eos = json.loads((builtin / "config.json").read_text())["eos_token_id"]
    for r, ids in zip(got, ref):
        assert r["completion_ids"] == trimmed(ids, eos)
        assert r["new_tokens"] == len(r["completion_ids"]) and set(r) >= {"id", "prompt", "completion", "new_tokens"}


def test_jsonl_prompts_own_group_size_line_number_ids(cache, tmp_path):
    prompts = ["def add(a, b):", "import os", "class A:", "x = [i for i in", "# experts"]
    src = tmp_path / "p.jsonl"
    lines = [json.dumps({"id": f"q{i}", "prompt": p}) if i % 2 == 0 else json.dumps({"prompt": p})
             for i, p in enumerate(prompts)]
    src.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")
    out = tmp_path / "out.jsonl"
    summary = run_job(RunConfig(prompts=str(src), out=str(out), max_new_tokens=NEW, progress=False,
                                rules="mixtral_offload", overrides=["pipeline.micro_batch_size=3"]))
    assert (summary["plan"].n, summary["plan"].bs) == (1, 3) and summary["stats"].groups == 2
    got = records(out)
    assert [r["id"] for r in got] == ["q0", 2, "q2", 5, "q4"]      # missing id -> line number (blank line counted)
    ref = hf_reference(cache, prompts, 3)
    eos = json.loads((cache / "config.json").read_text())["eos_token_id"]
    assert [r["completion_ids"] for r in got] == [trimmed(ids, eos) for ids in ref]


def test_sampling_is_seeded_per_group(cache, tmp_path):
    src = tmp_path / "p.txt"
    src.write_text("def f(x):\nimport sys\nclass B:\n")
    outs = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        out = tmp_path / f"{name}.jsonl"
        run_job(RunConfig(prompts=str(src), out=str(out), max_new_tokens=6, do_sample=True, temperature=1.5,
                          seed=seed, progress=False, rules="mixtral_offload"))
        outs.append([r["completion_ids"] for r in records(out)])
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_text_prompts_and_format_detection(tmp_path):
    f = tmp_path / "prompts"
    f.write_text('{"a": 1} is a dict\n\nsecond prompt\n')
    got = read_prompts(f)
    assert [(p.id, p.prompt) for p in got] == [(1, '{"a": 1} is a dict'), (3, "second prompt")]
    f.write_text('{"prompt": "x"}\n{"prompt": "y", "id": 7}\n')
    assert [(p.id, p.prompt) for p in read_prompts(f)] == [(1, "x"), (7, "y")]
    assert [p.prompt for p in read_prompts(f, "text")] == ['{"prompt": "x"}', '{"prompt": "y", "id": 7}']


def test_n_batches_auto_without_planner_profile_falls_back_to_one(caplog):
    with caplog.at_level(logging.WARNING, logger="kinject.plan.groups"):
        plan = plan_groups(PipelineConfig(n_batches="auto", micro_batch_size=4))
    assert (plan.n, plan.bs) == (1, 4)
    assert "n_batches: auto" in caplog.text and "using n_batches=1" in caplog.text
    assert plan_groups(PipelineConfig()).size == 8                      # nothing set: a group of 8


# ------------------------------------------------------------------ interruption and resume


SMALL_GROUPS = ["--set", "pipeline.micro_batch_size=2", "--set", "pipeline.n_batches=1"]


@pytest.fixture(scope="module")
def uninterrupted(cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out.jsonl"
    assert main(["run", "-q", "--out", str(out), "--max-new-tokens", str(NEW), *SMALL_GROUPS]) == 0
    return out.read_text()


def _wait_for_lines(path, proc=None, timeout=300.0):
    """Wait for the first whole group; generous, since a loaded 2-core machine may take a minute
    just to start the subprocess (the test asserts what is written, never how fast)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.exists() and path.read_text().count("\n") >= 1:
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"run ended before writing a group: {proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError("no group written in time")


def _check_partial(out, full_text):
    lines = out.read_text().splitlines(keepends=True)
    assert 0 < len(lines) < len(BUILTIN_PROMPTS) and len(lines) % 2 == 0      # whole groups of 2 only
    assert "".join(lines) == "".join(full_text.splitlines(keepends=True)[:len(lines)])


def test_sigterm_keeps_whole_groups_and_rerun_completes(cache, uninterrupted, tmp_path):
    out = tmp_path / "out.jsonl"
    # an emulated slow host->device link makes each group of 2 take ~1 s (tokens do not depend on it)
    cmd = [sys.executable, "-m", "kinject.app.cli", "run", "--out", str(out), "--max-new-tokens", str(NEW),
           *SMALL_GROUPS, "--set", "pipeline.emulate_bandwidth=0.004"]
    env = dict(os.environ, OMP_NUM_THREADS="1", KINJECT_CACHE=os.environ["KINJECT_CACHE"])
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_lines(out, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert "Traceback" not in err and "interrupted by SIGTERM" in last and "re-run" in last
    _check_partial(out, uninterrupted)
    # the same command again (emulation off: it only slows the link) finishes the job
    assert main(["run", "-q", "--out", str(out), "--max-new-tokens", str(NEW), *SMALL_GROUPS]) == 0
    assert out.read_text() == uninterrupted
    assert main(["run", "-q", "--out", str(out), "--max-new-tokens", str(NEW), *SMALL_GROUPS]) == 0
    assert out.read_text() == uninterrupted                               # nothing duplicated


def test_sigint_in_process_then_resume(cache, uninterrupted, tmp_path, capsys):
    out = tmp_path / "out.jsonl"

    def interrupt():
        _wait_for_lines(out)
        os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    t = threading.Thread(target=interrupt, daemon=True)
    t.start()
    rc = main(["run", "-q", "--out", str(out), "--max-new-tokens", str(NEW), *SMALL_GROUPS,
               "--set", "pipeline.emulate_bandwidth=0.004"])
    t.join(5)
    err = capsys.readouterr().err
    assert rc == 128 + signal.SIGINT and "interrupted by SIGINT" in err and err.count("\n") == 1
    _check_partial(out, uninterrupted)
    assert signal.getsignal(signal.SIGINT) is before                          # handler restored
    assert main(["run", "-q", "--out", str(out), "--max-new-tokens", str(NEW), *SMALL_GROUPS]) == 0
    assert out.read_text() == uninterrupted


def test_torn_last_line_is_dropped(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "completion": "a"}\n{"id": 2, "compl')
    assert done_ids(out) == {"1"}
    assert out.read_text() == '{"id": 1, "completion": "a"}\n'


# ------------------------------------------------------------------ user errors


def _error(capsys, argv):
    rc = main(["run", "-q", *argv])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and err.startswith("kinject: error:"), err
    return err


def test_bad_inputs_one_line_errors(cache, tmp_path, capsys):
    out = str(tmp_path / "out.jsonl")
    assert "prompts file not found" in _error(capsys, ["--prompts", str(tmp_path / "nope.jsonl"), "--out", out])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c",\n')
    assert "bad.jsonl:3: malformed JSON" in _error(capsys, ["--prompts", str(bad), "--out", out])
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    assert "bad.jsonl:2: no 'prompt' key" in _error(capsys, ["--prompts", str(bad), "--out", out])
    bad.write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    assert "bad.jsonl:2: duplicate id 1" in _error(capsys, ["--prompts", str(bad), "--out", out])
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert "cannot write output" in _error(capsys, ["--out", str(a_file / "out.jsonl")])
    assert "is a directory" in _error(capsys, ["--out", str(tmp_path)])
    err = _error(capsys, ["--out", out, "--set", "pipeline.n_batchez=2"])
    assert "n_batchez" in err and "n_batches" in err
    assert "--temperature" in _error(capsys, ["--out", out, "--temperature", "0.7"])
    assert "no config.json" in _error(capsys, ["--out", out, "--model", str(tmp_path)])
    assert not Path(out).exists()                                        # refused runs leave no file


def test_cli_error_exit_code_no_traceback(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    proc = subprocess.run([sys.executable, "-m", "kinject.app.cli", "run", "--prompts", str(bad),
                           "--out", str(tmp_path / "o.jsonl")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1 and "p.jsonl:2" in proc.stderr


# ------------------------------------------------------------------ pictures


def test_trace_and_plot(cache, tmp_path):
    src = tmp_path / "p.txt"
    src.write_text("def f(x):\nimport sys\nclass B:\nwhile True:\n")
    trace, plot = tmp_path / "t" / "trace.json", tmp_path / "pipeline.png"
    summary = run_job(RunConfig(prompts=str(src), out=str(tmp_path / "o.jsonl"), max_new_tokens=4,
                                trace=str(trace), plot=str(plot), progress=False,
                                overrides=["pipeline.emulate_bandwidth=1000"]))   # a link: weights move
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    streams = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    by_stream = {}
    for e in spans:
        if e["cat"] == "transfer":
            by_stream[streams[e["tid"]]] = by_stream.get(streams[e["tid"]], 0) + (e["args"]["nbytes"] or 0)
    moved = {s: b for s, b in summary["bytes_by_stream"].items() if b}
    assert moved and {"prefetch", "ondemand"} <= set(moved)              # klotski: both channels move data
    assert {s: by_stream.get(s) for s in moved} == moved                 # every stream that moved data has events
    weights = sum(b for s, b in moved.items() if s not in ("kv_load", "kv_store"))
    assert weights == sum(summary["bytes_moved"].values())   # weight streams account for the store's bytes moved
    assert {streams[e["tid"]] for e in spans} == set(streams.values())   # no empty rows
    assert any(streams[e["tid"]] == "compute" for e in spans)


def test_plot_without_matplotlib_keeps_the_job_and_says_so_in_one_line(tmp_path):
    """matplotlib is a dependency; if it cannot be imported anyway, the job still runs and writes
    its results, and the missing picture is one line on stderr, never a traceback."""
    proc = cli_without_matplotlib(["run", "--out", "o.jsonl", "--max-new-tokens", "2", "--plot", "p.png", "-q"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "p.png").exists()
    assert [ln for ln in proc.stderr.splitlines() if "matplotlib" in ln] == [
        next(ln for ln in proc.stderr.splitlines() if "no plot drawn" in ln)]
    assert len(records(tmp_path / "o.jsonl")) == len(BUILTIN_PROMPTS)


def test_cuda_peak_memory_line_names_allocated_and_reserved():
    """On CUDA the summary's peak is the allocator's max allocated, with what it held beside it (one
    pool per stream: reserved can exceed allocated). A stand-in runtime gives the store's CUDA keys."""
    from types import SimpleNamespace

    from kinject.app import run

    st = {"bytes": {}, "tier_bytes": {}, "cuda_max_allocated": 3 << 30, "cuda_max_reserved": 5 << 30}
    rt = SimpleNamespace(store=SimpleNamespace(summary=lambda: st), pipeline=SimpleNamespace(emulate_bandwidth=None),
                         transfer=SimpleNamespace(emulated=False), peek=lambda key: None,
                         tracer=SimpleNamespace(enabled=False))
    summary = {}
    run._collect_runtime(rt, summary)
    assert summary["peak_device"] == (3 << 30, "CUDA max allocated; the allocator held up to 5.00 GiB")
