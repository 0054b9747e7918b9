"""Expert correlation table (Klotski §6.2) and prefetch accuracy statistics."""

import json

import pytest
import torch

from kinject.errors import KinjectError
from kinject.engine.prefetch import CorrelationTable, PrefetchStats


def _long(rows):
    return torch.tensor(rows, dtype=torch.long)


# ---------------------------------------------------------------------------- counting
def test_build_top1_counts_and_freq():
    t = CorrelationTable(num_layers=2, num_experts=4)
    t.observe(0, _long([[0], [1], [0]]))
    t.observe(1, _long([[2], [3], [2]]))
    # token 0: 0 -> 2, token 1: 1 -> 3, token 2: 0 -> 2
    want = torch.zeros(4, 4, dtype=torch.long)
    want[0, 2], want[1, 3] = 2, 1
    assert torch.equal(t.counts[1], want)
    assert 0 not in t.counts                       # the first MoE layer has no predecessor
    assert t.freq[0].tolist() == [2, 1, 0, 0]
    assert t.freq[1].tolist() == [0, 0, 2, 1]
    assert t.top_k == 1


def test_build_top2_is_deterministic_and_accumulates():
    def build(steps):
        t = CorrelationTable(num_layers=2, num_experts=4, top_k=2)
        for _ in range(steps):
            t.reset_step()
            t.observe(0, _long([[0, 1], [2, 3]]))
            t.observe(1, _long([[1, 2], [0, 1]]))
        return t

    # token 0: {0,1} x {1,2}; token 1: {2,3} x {0,1}
    want = _long([[0, 1, 1, 0],
                  [0, 1, 1, 0],
                  [1, 1, 0, 0],
                  [1, 1, 0, 0]])
    a, b = build(1), build(1)
    assert torch.equal(a.counts[1], want) and torch.equal(b.counts[1], want)
    assert a.to_dict() == b.to_dict()
    two = build(2)
    assert torch.equal(two.counts[1], 2 * want)
    assert two.freq[1].tolist() == [2, 4, 2, 0]


def test_observe_rejects_bad_input():
    t = CorrelationTable(num_layers=2, num_experts=4, top_k=2)
    with pytest.raises(KinjectError, match="out of range"):
        t.observe(0, _long([[0, 4]]))
    with pytest.raises(KinjectError, match="top_k=2"):
        t.observe(0, _long([[0]]))
    with pytest.raises(KinjectError, match="integer tensor"):
        t.observe(0, torch.zeros(2, 2))
    t.observe(0, _long([[0, 1], [1, 2]]))
    with pytest.raises(KinjectError, match="same order"):
        t.observe(1, _long([[0, 1]]))            # 1 token now, 2 at layer 0 of this step


def test_non_contiguous_layer_ids_learnt_and_fixed():
    # DeepSeek-like: decoder layer 0 is dense, MoE layers are 1, 3, 5
    t = CorrelationTable(num_layers=3, num_experts=4)
    for step in range(2):
        t.observe(1, _long([[0], [1]]))
        t.observe(3, _long([[2], [2]]))
        t.observe(5, _long([[3], [1]]))          # step 2 restarts at layer 1: a new step, automatically
    assert t.layer_ids == [1, 3, 5]
    assert t.prev_layer(1) is None and t.prev_layer(3) == 1 and t.prev_layer(5) == 3
    assert t.counts[3][0, 2] == 2 and t.counts[3][1, 2] == 2
    assert t.counts[5][2, 3] == 2 and t.counts[5][2, 1] == 2
    assert set(t.counts) == {3, 5}
    with pytest.raises(KinjectError, match="num_layers=3"):
        t.observe(7, _long([[0], [1]]))         # a 4th MoE layer id

    fixed = CorrelationTable(num_layers=3, num_experts=4, layer_ids=[5, 1, 3])
    assert fixed.layer_ids == [1, 3, 5]
    with pytest.raises(KinjectError, match="not one of the MoE layer ids"):
        fixed.observe(2, _long([[0]]))

    # path length 2: layer 5 is conditioned on layer 1
    t2 = CorrelationTable(num_layers=3, num_experts=4, path_length=2, layer_ids=[1, 3, 5])
    t2.observe(1, _long([[0], [1]]))
    t2.observe(3, _long([[2], [2]]))
    t2.observe(5, _long([[3], [1]]))
    assert t2.prev_layer(5) == 1 and t2.prev_layer(3) is None
    assert set(t2.counts) == {5}
    assert t2.counts[5][0, 3] == 1 and t2.counts[5][1, 1] == 1


def test_reset_step_forgets_previous_choices():
    t = CorrelationTable(num_layers=2, num_experts=4)
    t.observe(0, _long([[0]]))
    t.reset_step()
    t.observe(1, _long([[2]]))
    assert 1 not in t.counts                    # nothing to pair with after the reset
    assert t.freq[1].tolist() == [0, 0, 1, 0]


# ---------------------------------------------------------------------------- prediction
def _hand_table(top_k=1, mode="prob"):
    t = CorrelationTable(num_layers=2, num_experts=4, top_k=top_k, layer_ids=[0, 1], mode=mode)
    t.counts[1] = _long([[0, 0, 9, 1],    # P(.|0) = [0, 0, .9, .1]
                         [0, 0, 1, 3],    # P(.|1) = [0, 0, .25, .75]
                         [5, 5, 0, 0],    # a tie
                         [0, 0, 0, 0]])   # never observed -> frequency fallback
    t.freq[1] = _long([1, 2, 3, 4])
    return t


def test_predict_row_normalised_vs_counts_vs_vote():
    t = _hand_table()
    prev = _long([[0], [1], [1]])        # one token came from expert 0, two from expert 1
    # prob:   1*[0,0,.9,.1] + 2*[0,0,.25,.75] = [0, 0, 1.4, 1.6]
    assert t.predict(1, prev, 1) == [3]
    assert t.predict(1, prev, 2) == [3, 2]
    # counts: 1*[0,0,9,1] + 2*[0,0,1,3] = [0, 0, 11, 7] (row 0's popularity dominates)
    assert t.predict(1, prev, 1, mode="counts") == [2]
    # vote (Klotski's released code): row 0 votes 2 (x1), row 1 votes 3 (x2)
    assert t.predict(1, prev, 2, mode="vote") == [3, 2]


def test_predict_fallbacks():
    t = _hand_table()
    assert t.predict(1, None, 2) == [3, 2]                 # freq so far: [1, 2, 3, 4]
    assert t.predict(1, _long([[3]]), 2) == [3, 2]         # empty row -> normalised freq
    assert t.predict(0, _long([[0]]), 2) == [0, 1]         # no data at all for layer 0
    empty = CorrelationTable(num_layers=4, num_experts=8)
    assert empty.predict(2, None, 3) == [0, 1, 2]
    assert empty.predict(2, _long([[5]]), 3) == [0, 1, 2]
    assert len(t.predict(1, None, 10)) == 4                # k capped at num_experts


def test_predict_ties_break_by_lower_id():
    t = _hand_table()
    assert t.predict(1, _long([[2]]), 1) == [0]            # [.5, .5, 0, 0]
    assert t.predict(1, _long([[2]]), 3) == [0, 1, 2]      # then 2 vs 3 at zero -> 2
    freq_tie = CorrelationTable(num_layers=1, num_experts=4)
    freq_tie.freq[0] = _long([1, 3, 3, 1])
    freq_tie.layer_ids = [0]
    assert freq_tie.predict(0, None, 3) == [1, 2, 0]


def test_predict_from_step_uses_remembered_choices():
    t = CorrelationTable(num_layers=2, num_experts=4, layer_ids=[0, 1])
    for _ in range(3):
        t.observe(0, _long([[0], [1]]))
        t.observe(1, _long([[2], [3]]))
    t.observe(0, _long([[1], [1]]))                        # new step: both tokens at expert 1
    assert t.predict_from_step(1, 1) == [3]
    assert t.freq[0].tolist() == [3, 5, 0, 0]
    assert t.predict_from_step(0, 2) == [1, 0]             # no predecessor layer: frequency so far


# ---------------------------------------------------------------------------- persistence
def test_save_load_round_trip(tmp_path):
    t = CorrelationTable(num_layers=3, num_experts=4, meta={"model": "tiny-mixtral", "sha": "abc"})
    for _ in range(2):
        t.observe(1, _long([[0, 1], [2, 3]]))
        t.observe(3, _long([[1, 2], [0, 1]]))
        t.observe(5, _long([[3, 2], [1, 0]]))
    path = tmp_path / "sub" / "table.json"
    t.save(path)
    u = CorrelationTable.load(path, num_layers=3, num_experts=4, meta={"model": "tiny-mixtral"})
    assert u.to_dict() == t.to_dict()
    assert u.layer_ids == [1, 3, 5] and u.meta == t.meta and u.top_k == 2
    for layer in (3, 5):
        assert torch.equal(u.counts[layer], t.counts[layer])
        assert u.predict(layer, _long([[0, 1]]), 2) == t.predict(layer, _long([[0, 1]]), 2)
    # loaded tables keep learning the same layer sequence
    u.observe(1, _long([[0, 1]]))
    u.observe(3, _long([[1, 2]]))


def test_load_shape_mismatch_is_a_clear_error(tmp_path):
    t = CorrelationTable(num_layers=2, num_experts=4, meta={"model": "a"})
    t.observe(0, _long([[0], [1]]))
    t.observe(1, _long([[2], [3]]))
    path = tmp_path / "t.json"
    t.save(path)
    with pytest.raises(KinjectError, match=r"num_experts=4, the model needs num_experts=8"):
        CorrelationTable.load(path, num_experts=8)
    with pytest.raises(KinjectError, match=r"meta\['model'\] is 'a', expected 'b'"):
        CorrelationTable.load(path, meta={"model": "b"})

    d = json.loads(path.read_text())
    d["layers"]["1"]["counts"] = [row[:3] for row in d["layers"]["1"]["counts"]]
    path.write_text(json.dumps(d))
    with pytest.raises(KinjectError, match=r"t\.json: layer 1 'counts' has shape 4x3, expected 4x4"):
        CorrelationTable.load(path)

    d["layers"]["1"].pop("counts")
    d["layers"]["1"]["freq"] = [1, 2]
    path.write_text(json.dumps(d))
    with pytest.raises(KinjectError, match=r"layer 1 'freq' has shape 2, expected 4"):
        CorrelationTable.load(path)

    path.write_text("{not json")
    with pytest.raises(KinjectError, match="not valid JSON"):
        CorrelationTable.load(path)
    with pytest.raises(KinjectError, match="no such file"):
        CorrelationTable.load(tmp_path / "missing.json")


def test_merge_and_copy():
    a = CorrelationTable(num_layers=2, num_experts=4)
    a.observe(0, _long([[0]]))
    a.observe(1, _long([[1]]))
    b = a.copy()
    b.observe(0, _long([[2]]))
    b.observe(1, _long([[3]]))
    assert a.counts[1].sum() == 1                       # the copy did not touch the original
    a.merge(b)
    assert a.counts[1][0, 1] == 2 and a.counts[1][2, 3] == 1
    assert a.freq[0].tolist() == [2, 0, 1, 0]
    with pytest.raises(KinjectError, match="num_experts differs"):
        a.merge(CorrelationTable(num_layers=2, num_experts=8))


# ---------------------------------------------------------------------------- stats
def test_prefetch_stats_hand_example():
    s = PrefetchStats(num_experts=8)
    # layer 0: token counts 0:3, 1:1, 2:3, 3:1 (8 assignments)
    s.record(0, [0, 1], _long([[0, 2], [0, 2], [2, 3], [0, 1]]))
    assert s.precision(0) == 1.0                 # both prefetched experts were used
    assert s.hot_accuracy(0) == 0.5              # true hottest 2 = {0, 2}; predicted {0, 1}
    assert s.coverage(0) == 0.5                  # (3 + 1) / 8
    # layer 1: expert 6 prefetched but unused
    s.record(1, [5, 6], {5: 4, 7: 2, 6: 0})
    assert s.precision(1) == 0.5
    assert s.hot_accuracy(1) == 0.5              # hottest 2 = {5, 7}
    assert s.coverage(1) == 4 / 6
    assert s.precision() == 3 / 4                # (2 + 1) / (2 + 2)
    assert s.hot_accuracy() == 2 / 4
    assert s.coverage() == 8 / 14
    rep = s.report()
    assert rep["layers"][1]["records"] == 1 and rep["overall"]["records"] == 2
    assert "75.0%" in s.summary()
    same = PrefetchStats(num_experts=8)           # counts per expert as a list, the prediction as a set
    same.record(0, {0, 1}, [3, 1, 3, 1, 0, 0, 0, 0])
    same.record(1, {5, 6}, [0, 0, 0, 0, 0, 4, 0, 2])
    assert same.report() == rep


def test_prefetch_stats_ties_and_empty():
    s = PrefetchStats()
    assert s.precision() is None and s.hot_accuracy() is None and s.coverage() is None
    s.record(0, [2, 1], {0: 2, 1: 2, 2: 2})      # three equally hot experts: any two are "the hottest 2"
    assert s.hot_accuracy() == 1.0
    s.record(1, [0, 1, 2], {4: 1})               # one used expert: K capped at 1, missed
    assert s.hot_accuracy(1) == 0.0 and s.precision(1) == 0.0


def _reference_prob_scores(t: CorrelationTable, layer: int, prev: torch.Tensor) -> torch.Tensor:
    """The scoring of the module docstring, written out: row-normalised table, empty rows -> freq share."""
    E = t.num_experts
    rows = t.counts[layer].to(torch.float64)
    freq = t.freq[layer].to(torch.float64)
    probs = rows / rows.sum(1, keepdim=True).clamp_min(1.0)
    probs[rows.sum(1) == 0] = freq / freq.sum()
    return torch.bincount(prev.flatten(), minlength=E).to(torch.float64) @ probs


@pytest.mark.parametrize("E", [8, 128])
def test_predict_matches_the_written_out_scoring_on_random_tables(E):
    """The fast path (row sums kept by observe, row weights in Python, one matmul, ranking in Python
    up to 256 experts) ranks like the plain formula, empty rows included, while the table keeps
    learning between predictions, after counts assigned by hand and after a merge."""
    g = torch.Generator().manual_seed(E)
    t = CorrelationTable(num_layers=2, num_experts=E, layer_ids=[0, 1])

    def check():
        assert t._row_sums(1, t.counts[1]) == t.counts[1].sum(1).tolist()
        prev = torch.randint(0, E, (9, 2), generator=g)    # some tokens on rows never observed
        score = _reference_prob_scores(t, 1, prev)
        want = sorted(range(E), key=lambda j: (-float(score[j]), j))[:5]
        got = t.predict(1, prev, 5)
        assert [round(float(score[j]), 9) for j in got] == [round(float(score[j]), 9) for j in want]

    for _ in range(3):                                      # few steps: many rows stay empty
        t.observe(0, torch.randint(0, E // 2, (6, 2), generator=g))
        t.observe(1, torch.randint(0, E, (6, 2), generator=g))
    for _ in range(5):
        check()
        t.observe(0, torch.randint(0, E // 2, (6, 2), generator=g))   # learning between predictions
        t.observe(1, torch.randint(0, E, (6, 2), generator=g))
    t.counts[1] = torch.randint(0, 3, (E, E), generator=g)            # set by hand: summed again
    check()
    other = t.copy()
    t.merge(other)
    check()


def test_predict_from_observed_choices_reuses_their_counts_and_agrees_with_a_copy():
    """Choices observed this step carry the counts observe() was given (or made): predict weighs the
    rows by those; the same choices as another tensor are counted again, with the same result."""
    g = torch.Generator().manual_seed(1)
    t = CorrelationTable(num_layers=2, num_experts=16, layer_ids=[0, 1])
    for _ in range(6):
        t.observe(0, torch.randint(0, 16, (8, 2), generator=g))
        t.observe(1, torch.randint(0, 16, (8, 2), generator=g))
    prev = torch.randint(0, 16, (8, 2), generator=g)
    t.observe(0, prev, counts=torch.bincount(prev.flatten(), minlength=16))
    assert torch.equal(t._step_counts[0], torch.bincount(prev.flatten(), minlength=16))
    assert t.predict(1, t.step_choices(0), 6, min_use=0.4) == t.predict(1, prev.clone(), 6, min_use=0.4)
    assert t.expected_tokens(1, t.step_choices(0)).tolist() == t.expected_tokens(1, prev.clone()).tolist()
    t.reset_step()
    assert not t._step_counts


def test_expected_tokens_are_tokens_per_expert_under_the_table():
    """Layer 1 always picks {0, 1} after expert 0 and {2, 3} after expert 1 at layer 0: 3 tokens on
    expert 0 and one on expert 1 are expected as 3 tokens on experts 0 and 1, one on 2 and 3."""
    t = CorrelationTable(num_layers=2, num_experts=8, layer_ids=[0, 1])
    for _ in range(4):
        t.observe(0, torch.tensor([[0, 4], [1, 5]]))
        t.observe(1, torch.tensor([[0, 1], [2, 3]]))
    prev = torch.tensor([[0, 4], [0, 4], [0, 4], [1, 5]])     # [T=4, k'=2]
    lam = t.expected_tokens(1, prev)
    assert lam.tolist() == pytest.approx([3, 3, 1, 1, 0, 0, 0, 0])
    assert float(lam.sum()) == pytest.approx(4 * 2)            # T x k choices
    # no previous choices: frequencies scaled to tokens x k
    assert t.expected_tokens(1, None, tokens=4).tolist() == pytest.approx([2, 2, 2, 2, 0, 0, 0, 0])
    assert t.expected_tokens(1, None) is None                  # no token count: cannot tell
    assert CorrelationTable(num_layers=2, num_experts=8).expected_tokens(1, prev) is None


def test_predict_min_use_adds_every_expert_likely_used():
    t = CorrelationTable(num_layers=2, num_experts=8, layer_ids=[0, 1])
    for _ in range(4):
        t.observe(0, torch.tensor([[0, 4], [1, 5]]))
        t.observe(1, torch.tensor([[0, 1], [2, 3]]))
    prev = torch.tensor([[0, 4], [0, 4], [0, 4], [1, 5]])     # expects 3, 3, 1, 1 tokens on experts 0-3
    assert t.predict(1, prev, 1) == [0]
    # P(used) >= 1 - exp(-lam): 0.95 for 3 tokens, 0.63 for 1 token, 0 for none
    assert t.predict(1, prev, 1, min_use=0.9) == [0, 1]
    assert t.predict(1, prev, 1, min_use=0.5) == [0, 1, 2, 3]
    assert t.predict(1, prev, 6, min_use=0.5) == [0, 1, 2, 3, 4, 5]   # never fewer than k
    assert t.predict(1, None, 1, min_use=0.5, tokens=1) == [0]        # freq fallback: 0.5 token each
    assert t.predict(1, None, 1, min_use=0.3, tokens=1) == [0, 1, 2, 3]
    assert t.predict(1, prev, 1, min_use=0.5, mode="vote") == [0]     # not an expectation: k only
    with pytest.raises(KinjectError, match="min_use"):
        t.predict(1, prev, 1, min_use=1.0)


def test_a_steps_observations_are_counted_in_one_batch_like_one_by_one():
    """Observations wait until the step ends (or the counts are read) and are then added for every
    layer at once: the counts equal a per-observation count written out here, over steps of
    different sizes, non-contiguous layer ids and a layer's counts replaced from outside mid-way."""
    g = torch.Generator().manual_seed(0)
    E, ids = 6, [1, 3, 4, 7]
    t = CorrelationTable(len(ids), E, layer_ids=ids)
    want_counts = {L: torch.zeros(E, E, dtype=torch.long) for L in ids[1:]}
    want_freq = {L: torch.zeros(E, dtype=torch.long) for L in ids}
    for step, tokens in enumerate((5, 1, 1, 3, 1)):
        prev = None
        for L in ids:
            c = torch.randint(0, E, (tokens, 2), generator=g)
            t.observe(L, c)
            assert L in t._pending_layers                      # not counted yet
            for row in c.tolist():
                for j in row:
                    want_freq[L][j] += 1
            if prev is not None:
                for r, row in enumerate(c.tolist()):
                    for i in prev[r]:
                        for j in row:
                            want_counts[L][i, j] += 1
            prev = c.tolist()
        if step == 2:                                          # a hand edit, then more observations
            t.counts[4] = t.counts[4] * 2
            want_counts[4] *= 2
    for L in ids:
        assert torch.equal(t.freq[L], want_freq[L]), L
    for L in ids[1:]:
        assert torch.equal(t.counts[L], want_counts[L]), L
    assert not t._pending and ids[0] not in t.counts


@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("mode", ["prob", "counts"])
def test_prediction_scores_are_the_row_weighted_sum_of_the_table(tokens, mode):
    """The score is sum_i w_i counts[i, .] over the previous experts' token counts (``prob``: each row
    normalised, a token on a row never observed scoring by freq), whether the tokens come from a few
    previous experts (a decode step) or from most (a prefill); the ranking follows it, ties by id."""
    gen = torch.Generator().manual_seed(tokens)
    E, k = 32, 4
    t = CorrelationTable(num_layers=2, num_experts=E, top_k=k, layer_ids=[0, 1], mode=mode)
    for _ in range(6):
        t.observe(0, torch.randint(0, E - 4, (8, k), generator=gen))            # experts E-4.. never seen at 0
        t.observe(1, torch.randint(0, E, (8, k), generator=gen))
        t.reset_step()
    prev = torch.randint(0, E, (tokens, k), generator=gen)
    prev[0, 0] = E - 1                                                          # a row never observed
    counts, freq = t.counts[1].to(torch.float64), t.freq[1].to(torch.float64)
    n = torch.bincount(prev.flatten(), minlength=E).to(torch.float64)
    rowsum = counts.sum(1)
    if mode == "counts":
        want = n @ counts
    else:
        seen = rowsum > 0
        want = torch.where(seen, n / rowsum.clamp(min=1), torch.zeros_like(n)) @ counts
        want += freq * (n[~seen].sum() / freq.sum())
    got = t.expected_tokens(1, prev) if mode == "prob" else None
    if got is not None:
        assert torch.allclose(got / (k / prev.shape[1]), want, rtol=1e-12, atol=1e-12)
    ranked = t.predict(1, prev, E, mode=mode)
    assert ranked == sorted(range(E), key=lambda j: (-float(want[j]), j))
