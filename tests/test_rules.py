"""Rule files: every bad input is refused with file / rule / key, before the model changes."""

import textwrap

import pytest
import torch

import kinject
from kinject.errors import InjectionError, RuleError
from kinject.rules import load_rules, parse_size
from kinject.testing import build_tiny_model

MIXTRAL_ATTN = "transformers.models.mixtral.modeling_mixtral.MixtralAttention"
GOOD_RULES = f"""
pipeline:
  device: cpu
rules:
  - match: {{class: {MIXTRAL_ATTN}}}
    replace: {{class: default}}
  - match: {{name: '^model\\.layers\\.\\d+\\.mlp\\.experts$'}}
    replace: {{class: default}}
"""


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("mixtral")


def snapshot(model):
    """Module objects and tensor storages by name: 'exactly as it was' means all equal."""
    mods = [(n, id(m)) for n, m in model.named_modules()]
    tensors = {k: (v.data_ptr(), v.device, v.clone()) for k, v in model.state_dict().items()}
    return mods, tensors


def assert_unchanged(model, snap):
    mods, tensors = snapshot(model)
    assert mods == snap[0]
    assert tensors.keys() == snap[1].keys()
    for k, (ptr, dev, val) in tensors.items():
        assert ptr == snap[1][k][0] and dev == snap[1][k][1], k
        assert torch.equal(val, snap[1][k][2]), k
    assert getattr(model, "kinject", None) is None


def write(tmp_path, text, name="rules.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


# (id, yaml text, expected rule index or None, expected key fragment, message fragment)
BAD = [
    ("malformed-yaml", "rules:\n  - match: {name: 'x'\n    replace: {class: default}\n", None, None, "malformed YAML"),
    ("top-key", "pipelin: {device: cpu}\nrules: []\n", None, "pipelin", "unknown top-level key"),
    ("rules-not-list", "rules: {match: x}\n", None, "rules", "must be a list"),
    ("rule-key", "rules:\n  - match: {name: experts}\n    replce: {class: default}\n", 0, "replce", "unknown rule key"),
    ("empty-match", "rules:\n  - match: {}\n    replace: {class: default}\n", 0, "match", "non-empty"),
    ("match-key", "rules:\n  - match: {nme: experts}\n    replace: {class: default}\n", 0, "match.nme", "did you mean 'name'"),
    ("bad-regex", "rules:\n  - match: {name: experts}\n    replace: {class: default}\n"
                  "  - match: {name: 'model.(layers'}\n    replace: {class: default}\n", 1, "match.name", "bad regex"),
    ("bad-class-regex", "rules:\n  - match: {class_name: 'Experts('}\n    replace: {class: default}\n",
     0, "match.class_name", "bad regex"),
    ("no-match-class-name", "rules:\n  - match: {class_name: 'MixtralAtention$'}\n    replace: {class: default}\n",
     0, "match", "closest classes in the model"),
    ("replace-module", "rules:\n  - match: {name: experts}\n    replace: {class: operators.nope.Thing}\n",
     0, "replace.class", "cannot import 'operators.nope.Thing'"),
    ("replace-attr", "rules:\n  - match: {name: experts}\n    replace: {class: operators.base.Defualt}\n",
     0, "replace.class", "did you mean 'Default'"),
    ("match-class", f"rules:\n  - match: {{class: {MIXTRAL_ATTN}x}}\n    replace: {{class: default}}\n",
     0, "match.class", "has no 'MixtralAttentionx'"),
    ("unknown-kwarg", "rules:\n  - match: {name: experts}\n    replace: {class: default, kwargs: {devise: cpu}}\n",
     0, "replace.kwargs.devise", "does not take 'devise'"),
    ("kwarg-type", "rules:\n  - match: {name: experts}\n    replace: {class: default, kwargs: {device: 3}}\n",
     0, "replace.kwargs.device", "expected str or null"),
    ("kwarg-literal", "rules:\n  - match: {name: experts}\n    replace: {class: helpers.fault_ops.MetaOnAttach, kwargs: {mode: c}}\n",
     0, "replace.kwargs.mode", "expected one of ['a', 'b']"),
    ("reserved-kwarg", "rules:\n  - match: {name: experts}\n    replace: {class: default, kwargs: {runtime: x}}\n",
     0, "replace.kwargs.runtime", "set by kinject"),
    ("not-operator", "rules:\n  - match: {name: experts}\n    replace: {class: helpers.fault_ops.NotAnOperator}\n",
     0, "replace.class", "not a kinject operator"),
    ("recursive-type", "rules:\n  - match: {name: experts}\n    replace: {class: default}\n    recursive: maybe\n",
     0, "recursive", "true or false"),
    ("pipeline-key", "pipeline: {micro_batch: 4}\nrules:\n  - match: {name: experts}\n    replace: {class: default}\n",
     None, "pipeline.micro_batch", "did you mean 'micro_batch_size'"),
    ("pipeline-size", "pipeline: {device_budget: 22GiBs}\nrules:\n  - match: {name: experts}\n    replace: {class: default}\n",
     None, "pipeline.device_budget", "not a size"),
    ("pipeline-type", "pipeline: {micro_batch_size: four}\nrules:\n  - match: {name: experts}\n    replace: {class: default}\n",
     None, "pipeline.micro_batch_size", "expected int"),
    ("interpolation", "pipeline: {offload_dir: '${nowhere.dir}'}\nrules:\n  - match: {name: experts}\n    replace: {class: default}\n",
     None, "offload_dir", "interpolation failed"),
    ("no-match", "rules:\n  - match: {name: experts}\n    replace: {class: default}\n"
                 "  - match: {name: '^model\\.layerz\\.\\d+\\.mlp$'}\n    replace: {class: default}\n",
     1, "match", "matched no module; closest module names"),
    ("no-match-class", "rules:\n  - match: {class: MixtralAtention}\n    replace: {class: default}\n",
     0, "match", "closest classes in the model: MixtralAttention"),
    ("build-fails", "rules:\n  - match: {name: experts}\n    replace: {class: default, kwargs: {device: 'warp:0'}}\n",
     0, "replace", "building operators.base.Default for module 'model.layers.0.mlp.experts' failed"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_rule_file_names_rule_and_key_and_leaves_model_untouched(tmp_path, model, case):
    _, text, rule, key, fragment = case
    path = write(tmp_path, text)
    snap = snapshot(model)
    with pytest.raises(RuleError) as ei:
        kinject.optimize(model, path)
    msg = str(ei.value)
    assert str(path) in msg
    assert fragment in msg, msg
    assert ei.value.rule == rule, msg
    if rule is not None:
        assert f"rule {rule}" in msg
    if key is not None:
        assert key in (ei.value.key or ""), msg
    assert_unchanged(model, snap)


def test_yaml_line_numbers(tmp_path):
    path = write(tmp_path, "rules:\n  - match: {name: a}\n    replace: {class: default}\n"
                           "  - match: {name: b}\n    replace: {class: default, kwargs: {devise: x}}\n")
    with pytest.raises(RuleError) as ei:
        load_rules(path)
    assert ei.value.line == 5 and f"{path}:5" in str(ei.value)


def test_attach_failure_rolls_back_everything(tmp_path, model):
    path = write(tmp_path, "rules:\n  - match: {name: '\\.self_attn$'}\n"
                           "    replace: {class: helpers.fault_ops.MetaOnAttach, kwargs: {fail_on: model.layers.1.self_attn}}\n"
                           "  - match: {name: 'mlp\\.experts$'}\n    replace: {class: helpers.fault_ops.MetaOnAttach}\n")
    snap = snapshot(model)
    with pytest.raises(InjectionError, match="while attaching rule 0 .* to 'model.layers.1.self_attn'.*model left unchanged"):
        kinject.optimize(model, path)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("override,fragment", [
    ("pipeline.n_batches=zero", "positive integer or 'auto'"),
    ("pipeline.bogus=1", "unknown pipeline key 'bogus'"),
    ("rules.7.optional=true", "cannot be applied"),
    ("n_batches=3", "must start with 'pipeline.', 'rules.' or 'vars.'"),
    ("pipeline.n_batches", "not key=value"),
])
def test_bad_overrides(tmp_path, model, override, fragment):
    path = write(tmp_path, GOOD_RULES)
    snap = snapshot(model)
    with pytest.raises(RuleError, match=fragment):
        kinject.optimize(model, path, overrides=[override])
    assert_unchanged(model, snap)


def test_overrides_and_interpolation(tmp_path, model):
    path = write(tmp_path, "pipeline:\n  device: cpu\n  micro_batch_size: 4\n  offload_dir: /tmp/k/${pipeline.micro_batch_size}\n"
                 + GOOD_RULES.split("cpu\n", 1)[1])
    rs = load_rules(path, ["pipeline.n_batches=8", "pipeline.micro_batch_size=2", "rules.1.optional=true",
                           "pipeline.device_budget=1.5GiB"])
    assert rs.pipeline.n_batches == 8 and rs.pipeline.micro_batch_size == 2
    assert rs.pipeline.offload_dir == "/tmp/k/2"            # interpolation sees the override
    assert rs.pipeline.device_budget == int(1.5 * 2**30)
    assert rs.rules[1].optional is True
    kinject.optimize(model, path, overrides=["pipeline.n_batches=auto"])
    try:
        assert model.kinject.pipeline.n_batches == "auto"
    finally:
        kinject.restore(model)


def test_parse_size():
    assert parse_size("6GiB") == 6 * 2**30 and parse_size("512MB") == 512 * 10**6 and parse_size(7) == 7
    with pytest.raises(ValueError):
        parse_size("lots")


# ------------------------------------------------------------------ extends, shipped names, without_child


BASE = """\
vars:
  weights: host
  order: hot_first
pipeline:
  device: cpu
  micro_batch_size: 2
rules:
  - match: {name: '\\.self_attn$'}
    replace: {class: default}
  - match: {name: '\\.experts$'}
    replace: {class: default, kwargs: {device: '${vars.weights}'}}
"""


def test_extends_merges_vars_and_pipeline_replaces_same_match_in_place_and_puts_new_rules_first(tmp_path):
    write(tmp_path, BASE, "base.yaml")
    child = write(tmp_path, """\
        extends: base.yaml
        vars:
          weights: cpu
        pipeline:
          micro_batch_size: 4
        rules:
          - match: {name: '\\.experts$'}
            replace: {class: default}
          - match: {name: '\\.gate$'}
            replace: {class: default}
            optional: true
        """, "child.yaml")
    rs = load_rules(child)
    assert rs.pipeline.micro_batch_size == 4 and rs.pipeline.device == "cpu"
    assert [r.match.name for r in rs.rules] == [r"\.gate$", r"\.self_attn$", r"\.experts$"]
    assert rs.rules[2].kwargs == {}                                  # the child's experts rule, in the base's place
    assert [(r.file.rsplit("/", 1)[-1], r.line) for r in rs.rules] == [("child.yaml", 9), ("base.yaml", 8),
                                                                       ("child.yaml", 7)]
    assert load_rules(child, ["rules.0.optional=false"]).rules[0].optional is False


def test_extends_error_in_the_base_names_the_base_file_and_line(tmp_path):
    write(tmp_path, BASE.replace("replace: {class: default}\n", "replace: {class: default, kwargs: {devise: x}}\n", 1),
          "base.yaml")
    child = write(tmp_path, "extends: base.yaml\nrules: []\n", "child.yaml")
    with pytest.raises(RuleError) as ei:
        load_rules(child)
    assert f"{tmp_path / 'base.yaml'}:9" in str(ei.value) and ei.value.key == "replace.kwargs.devise"


@pytest.mark.parametrize("text, fragment", [
    ("extends: nowhere.yaml\nrules: []\n", "base rule file 'nowhere.yaml' not found"),
    ("extends: self.yaml\nrules: []\n", "loops back"),
    ("extends: [a]\nrules: []\n", "must be a rule file name or path"),
])
def test_bad_extends(tmp_path, text, fragment):
    path = write(tmp_path, text, "self.yaml")
    with pytest.raises(RuleError) as ei:
        load_rules(path)
    assert fragment in str(ei.value) and ei.value.key == "extends" and ei.value.line == 1


def test_family_rule_names_of_earlier_releases_resolve_to_the_generic_strategy_files():
    from kinject.rules import builtin_rules_dir, resolve_rules_path

    shipped = builtin_rules_dir()
    assert resolve_rules_path("rules/mixtral_klotski.yaml") == shipped / "klotski.yaml"
    assert resolve_rules_path("qwen3_moe_kv_offload") == shipped / "kv_offload.yaml"
    assert resolve_rules_path("mixtral_klotski_hqq") == shipped / "klotski_hqq.yaml"
    assert resolve_rules_path("rules/nofamily_klotski.yaml").name == "nofamily_klotski.yaml"   # not a model type
    with pytest.raises(RuleError, match="rule file not found"):
        load_rules("rules/nofamily_klotski.yaml")


def test_shipped_rules_are_one_file_per_strategy_and_name_no_family_class():
    from kinject.rules import builtin_rules_dir

    files = sorted(p.name for p in builtin_rules_dir().glob("*.yaml"))
    assert files == ["hot_prefetch.yaml", "hybrid.yaml", "klotski.yaml", "klotski_hqq.yaml", "kv_offload.yaml",
                     "mixed_precision.yaml", "multibatch.yaml",
                     "offload.yaml", "resident.yaml", "simple_pipeline.yaml"]
    for name in files:
        assert "transformers.models" not in (builtin_rules_dir() / name).read_text(), name


def test_without_child_tells_a_dense_mlp_from_a_moe_block_of_the_same_class_name():
    from torch import nn

    from kinject.inject import match_rule

    dense = nn.Module()
    dense.up_proj = nn.Linear(2, 2)
    block = nn.Module()
    block.router, block.experts = nn.Linear(2, 2), nn.Module()
    (rule,) = load_rules({"rules": [{"match": {"name": r"\.mlp$", "without_child": "^(experts|router)$"},
                                     "replace": {"class": "default"}}]}).rules
    assert match_rule(rule, "model.layers.0.mlp", dense)
    assert not match_rule(rule, "model.layers.1.mlp", block)


def test_with_children_matches_a_block_holding_several_experts_modules():
    from torch import nn

    from kinject.inject import match_rule

    class ParallelExperts(nn.Linear):
        pass

    two, one = nn.Module(), nn.Module()
    two.input_linear, two.output_linear, two.router = ParallelExperts(2, 2), ParallelExperts(2, 2), nn.Linear(2, 2)
    one.experts, one.gate = ParallelExperts(2, 2), nn.Linear(2, 2)
    (rule,) = load_rules({"rules": [{"match": {"name": r"\.mlp$", "with_children": {"class_name": "Experts$", "min": 2}},
                                     "replace": {"class": "default"}}]}).rules
    assert match_rule(rule, "model.layers.0.mlp", two)
    assert not match_rule(rule, "model.layers.0.mlp", one)
    assert "with_children={class_name: 'Experts$', min: 2}" in rule.describe()
    with pytest.raises(RuleError, match="with_children"):
        load_rules({"rules": [{"match": {"name": "x", "with_children": {"class_name": "x", "min": 0}}, "replace": {"class": "default"}}]})
