"""``kinject demo`` tells the story: the built-in model under one device budget that counts weights,
KV and activations; accelerate at the largest batch that fits, Klotski at the planner's n x bs, the
same greedy tokens (no timing asserts)."""

import pytest
import torch

from helpers.cli_helpers import cli_without_matplotlib
from kinject.app.cli import main
from kinject.app.demo import (ACC, HF, KLOTSKI, activation_bytes, kv_bytes, largest_acc_batch, moved_per_step,
                              run_demo)
from kinject.errors import KinjectError


@pytest.fixture(scope="module")
def fixture_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    from kinject.fixtures import tiny_moe_path

    config = AutoConfig.from_pretrained(tiny_moe_path())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return config, skeleton


def test_demo_runs_every_contender_within_one_all_inclusive_budget_with_identical_tokens(tmp_path, capsys):
    result = run_demo(batch=8, prompt_len=24, new_tokens=3, repeats=1, plot=str(tmp_path / "demo.png"),
                      trace=str(tmp_path / "t.json"))
    out = capsys.readouterr().out
    head = out.splitlines()
    assert "kinject demo" in head[0] and "8 prompts of 24 tokens x 3 new tokens" in head[0]
    assert "device budget" in head[1] and "50% of the weights" in head[1] and "EMULATED" in head[1]
    assert "weights, KV cache, activations" in head[1]
    assert [ln.split("  ")[1].strip() for ln in head[3:6]] == [HF, ACC, KLOTSKI]   # the table comes first
    assert head[6].lstrip().startswith("peak device = weights")
    assert head[7].startswith("kinject Klotski makes") and "x the tokens/s of accelerate's offload" in head[7]
    assert "at the same" in head[7] and "budget" in head[7] and "EMULATED" in head[7]
    rows, device, meta = result["rows"], result["device"], result["meta"]
    hf, acc, klotski = rows
    assert [r.name for r in rows] == [HF, ACC, KLOTSKI]
    assert acc.same_tokens and klotski.same_tokens and result["identical"]
    assert all(" yes" in ln for ln in head[4:6]) and "reference" in head[3]
    budget, weights = result["budget"], result["weights"]
    assert budget == int(weights * 0.5)
    # every byte on the device counted, and every offload contender within the one budget
    assert device[0].total > budget and device[0].weights == weights and moved_per_step(hf) == 0
    for row, d in zip((acc, klotski), device[1:]):
        assert 0 < d.weights and 0 < d.kv and 0 < d.activations and d.total <= budget
        assert moved_per_step(row) > 0
    # accelerate: the batch the demo found, its KV its own cache's, its weights what its hooks hold
    assert f"of 8 sequences {acc.per_call} are the most that fit" in head[8] or \
        (acc.per_call == 8 and "of 8 sequences all 8 fit" in head[8])
    assert head[10].startswith("Per sequence, the prefill's activations take") and "cap" in head[10]
    assert "prefills layer by layer" in head[9] and "once per layer" in head[9]
    assert acc.peak == device[1].weights and moved_per_step(acc) == acc.per_forward
    # Klotski: the planner's n x bs per generate, its KV on the device measured, its store within what is left
    assert klotski.per_call == meta["n"] * meta["bs"] and f"n={meta['n']} x bs={meta['bs']}" in head[9]
    assert device[2].kv == klotski.kv_peak < device[0].kv and klotski.peak <= meta["klotski_weights_budget"]
    # its decode steps' attention over decode chunks (pipeline.decode_chunk: auto): their KV and activations fit too
    assert device[2].weights + device[2].kv + device[2].decode_activations <= budget
    assert klotski.runtime.pipeline.decode_chunk == "auto" and klotski.runtime.pipeline.kv_budget
    assert klotski.runtime.transfer.emulated
    # 3 forwards a call, Klotski's too: its prefill runs each layer per micro-batch inside one forward
    assert acc.steps == 3 * -(-8 // acc.per_call) and klotski.steps == 3 * -(-8 // klotski.per_call)
    assert meta["prefill"] == "layer"
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "t.json").is_file()
    assert set(result["timings"]) >= {"startup", "import", "plan", "load", "warmup", "runs", "plot", "total"}
    assert "demo wall time" in out


def test_accelerates_batch_is_the_largest_whose_weights_kv_and_activations_fit(fixture_model):
    """At the demo's defaults (32 prompts of 128 tokens + 8 new, half the weights as budget) accelerate
    fits fewer sequences than the prompts: one more would overflow the budget."""
    from kinject.bench.contenders import acc_budget_peak

    config, skeleton = fixture_model
    weights = sum(p.numel() * p.element_size() for p in skeleton.parameters())
    budget = int(weights * 0.5)
    b, used = largest_acc_batch(skeleton, config, budget, 32, 128, 136)
    assert 1 <= b < 32 and used.total <= budget
    assert used.kv == kv_bytes(config, b, 136) and used.activations == activation_bytes(config, b, 128, b)
    room = budget - kv_bytes(config, b + 1, 136) - activation_bytes(config, b + 1, 128, b + 1)
    assert acc_budget_peak(skeleton, room) > room                          # b + 1 does not fit
    with pytest.raises(KinjectError, match="raise --budget"):
        largest_acc_batch(skeleton, config, 2**20, 32, 128, 136)


def test_klotski_fits_a_batch_group_several_times_accelerates_at_the_demo_defaults(fixture_model, tmp_path):
    """Same budget, same 32 prompts of 128 tokens: a layer-wise prefill (one micro-batch's activations
    beside one copy of the group's hidden states), Klotski's planned group holds every prompt, over 4x
    the batch accelerate fits, within the budget by the planner's memory model; by micro-batch too."""
    from kinject.app.demo import klotski_activation_bytes, klotski_plan, kv_working_bytes
    from kinject.app.run import default_model_path

    config, skeleton = fixture_model
    budget = int(sum(p.numel() * p.element_size() for p in skeleton.parameters()) * 0.5)
    acc_b, _ = largest_acc_batch(skeleton, config, budget, 32, 128, 135)
    n, bs, act = klotski_plan(default_model_path(), "rules/klotski.yaml", (), config, budget=budget, sequences=32,
                              prompt_len=128, tokens=135, bandwidth=1.0, workdir=tmp_path)
    assert n * bs == 32 and n * bs >= 4 * acc_b
    assert act == klotski_activation_bytes(config, n, bs, 128) < activation_bytes(config, acc_b, 128, acc_b)
    assert act + kv_working_bytes(config, bs, 135) < budget
    assert act == max(activation_bytes(config, bs, 128, bs) + 32 * 128 * config.hidden_size * 4,
                      2 * 32 * 128 * config.hidden_size * 4 + 32 * config.vocab_size * 4)
    n, bs, act = klotski_plan(default_model_path(), "rules/klotski.yaml", (), config, budget=budget, sequences=32,
                              prompt_len=128, tokens=135, bandwidth=1.0, workdir=tmp_path, prefill="micro_batch")
    assert n * bs == 32 and act == klotski_activation_bytes(config, n, bs, 128, prefill="micro_batch")


def test_kv_bytes_is_the_cache_transformers_builds(fixture_model):
    from transformers import AutoModelForCausalLM

    from kinject.fixtures import tiny_moe_path

    config, _ = fixture_model
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32).eval()
    ids = torch.randint(3, 100, (3, 10))
    out = model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == kv_bytes(config, 3, 10 + 4 - 1)        # the last token's KV is never computed


def test_demo_command_exits_zero(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--batch", "2", "--prompt-len", "16", "--max-new-tokens", "2", "--repeats", "1",
                 "--plot", "p.png"]) == 0
    assert (tmp_path / "p.png").is_file()
    assert "kinject Klotski makes" in capsys.readouterr().out
    assert main(["demo", "--budget", "0"]) == 2                              # a user error: one line, exit 2
    assert "--budget" in capsys.readouterr().err
    assert main(["demo", "--budget", "0.02", "--batch", "2", "--prompt-len", "16"]) == 2   # fits nothing: said so
    assert "raise --budget" in capsys.readouterr().err


def test_demo_without_matplotlib_still_runs_and_says_so_in_one_line(tmp_path):
    """matplotlib is a dependency, but a broken or missing one costs the picture only."""
    proc = cli_without_matplotlib(["demo", "--batch", "2", "--prompt-len", "16", "--max-new-tokens", "2",
                                   "--repeats", "1", "--plot", "p.png"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "p.png").exists()
    lines = [ln for ln in proc.stderr.splitlines() if "matplotlib" in ln]
    assert len(lines) == 1 and "no plot drawn" in lines[0]
    assert "kinject Klotski makes" in proc.stdout


def test_prefill_chunk_is_the_most_micro_batches_whose_activations_fit_klotskis_room(fixture_model):
    """A layer call of k micro-batches (experts over all their tokens) takes no more activation room
    than Klotski's layer-wise prefill already takes with one; k + 1 would."""
    from kinject.app.demo import klotski_activation_bytes, largest_prefill_chunk

    config, _ = fixture_model
    # the demo's defaults: 1 (the experts' rows per token outweigh the hidden states); short prompts: more
    for n, bs, prompt_len, want in ((16, 2, 128, 1), (16, 2, 4, 5), (32, 1, 2, 20)):
        k = largest_prefill_chunk(config, n, bs, prompt_len)
        assert k == want
        room = klotski_activation_bytes(config, n, bs, prompt_len, prefill="layer")
        assert 1 <= k <= n and klotski_activation_bytes(config, n, bs, prompt_len, prefill="layer", prefill_chunk=k) == room
        assert k == n or klotski_activation_bytes(config, n, bs, prompt_len, prefill="layer", prefill_chunk=k + 1) > room
