"""lm-evaluation-harness drives a kinject model (skipped where the optional 'lm-eval' is missing)."""

import math

import pytest
import torch

pytest.importorskip("lm_eval")


def test_loglikelihood_through_kinject_matches_the_model(tmp_path):
    from lm_eval.api.instance import Instance

    from kinject.app.lm_eval_adapter import KinjectLM
    from kinject.testing import save_tiny_model

    path = save_tiny_model("mixtral", tmp_path / "m")
    lm = KinjectLM(model=str(path), rules="rules/klotski.yaml", dtype="float32", batch_size=2,
                   set=f"vars.quant={{format: int4, group_size: 32}};pipeline.offload_dir={tmp_path / 'off'}")
    try:
        assert any(u.quant for u in lm.runtime.store.units.values())
        pairs = [("def f(x):", " return x"), ("import", " os"), ("a = 1\nb =", " 2")]
        reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
        got = lm.loglikelihood(reqs)
        tok, model = lm.tokenizer, lm.model
        for (context, cont), (ll, _) in zip(pairs, got):
            ctx = tok(context)["input_ids"]
            whole = tok(context + cont)["input_ids"]
            ids = torch.tensor([whole])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
            n = len(whole) - len(ctx)
            want = sum(float(logp[len(whole) - n - 1 + k, whole[len(whole) - n + k]]) for k in range(n))
            assert math.isfinite(ll) and ll == pytest.approx(want, abs=1e-3)
    finally:
        lm.close()
