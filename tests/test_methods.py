"""The method table (gtpo/methods.py): its rows against the presets, the knob registry against the YAML, the one list.

.venv/bin/python -m pytest -q tests/test_methods.py
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from gtpo import methods
from gtpo.methods import ENTROPY, FIELDS, KNOBS, METHODS, RESPONSES, Method, fields_needed, knob
from tests.conftest import REPO_ROOT

RECIPE_YAML = REPO_ROOT / "recipe" / "gtpo" / "config" / "gtpo_trainer.yaml"


@pytest.mark.parametrize("name", list(METHODS))
def test_each_row_has_its_preset_selecting_its_estimator(name):
    row = METHODS[name]
    preset = OmegaConf.load(REPO_ROOT / "configs" / "method" / f"{name}.yaml")
    assert preset.algorithm.adv_estimator == row.adv_estimator
    if row.policy_loss is not None:
        assert preset.actor_rollout_ref.actor.policy_loss.loss_mode == row.name
    if row.applies_grop:
        assert preset.algorithm.grop.enable is True  # the paper's §3.1
    if row.knobs == "forking":
        assert preset.algorithm.forking.enable is True


def test_every_preset_is_a_row():
    presets = {path.stem for path in (REPO_ROOT / "configs" / "method").glob("*.yaml")}
    assert presets == set(METHODS)


def _yaml_blocks() -> dict:
    algorithm = OmegaConf.to_container(OmegaConf.load(RECIPE_YAML).algorithm, resolve=False)
    return {key: value for key, value in algorithm.items() if isinstance(value, dict)}


def test_yaml_defaults_equal_the_dataclasses():
    """Every knob block declared in the recipe's YAML reads, with its declared values, into its dataclass's defaults:
    a default changed on one side only is caught here (one test for every block)."""
    blocks = {key: value for key, value in _yaml_blocks().items() if key in KNOBS}
    assert set(blocks) == set(KNOBS), f"knob blocks without a YAML declaration: {sorted(set(KNOBS) - set(blocks))}"
    for block, values in blocks.items():
        fields = {f.name for f in dataclasses.fields(KNOBS[block]) if f.init}
        assert set(values) == fields, f"algorithm.{block}: YAML {sorted(values)} != dataclass {sorted(fields)}"
        assert knob({block: values}, block) == KNOBS[block](), f"algorithm.{block}: a YAML default differs"


def test_the_recipe_blocks_of_the_yaml_are_all_knob_blocks():
    """A block under ``algorithm`` that is neither verl's nor in the registry would never be read."""
    verl_blocks = {"kl_ctrl", "filter_groups", "rollout_correction", "pf_ppo"}
    orphans = set(_yaml_blocks()) - set(KNOBS) - verl_blocks
    assert orphans == set()


def test_knob_names_the_key_and_the_valid_blocks():
    with pytest.raises(ValueError, match=r"algorithm\.gtpo\.alpha2=-1"):
        knob({"gtpo": {"alpha2": -1}}, "gtpo")
    with pytest.raises(ValueError, match=r"unknown key\(s\) algorithm\.grop\.gamma_1"):
        knob({"grop": {"gamma_1": 0.5}}, "grop")
    with pytest.raises(ValueError, match="not a knob block of the recipe; valid: .*forking"):
        knob({}, "fork")
    assert knob(None, "watchdog") == KNOBS["watchdog"]()


def test_fields_needed_follow_the_rows_and_their_knobs():
    def needed(**algorithm):
        return fields_needed(OmegaConf.create(algorithm))

    assert needed(adv_estimator="gtpo") == (ENTROPY,)
    assert needed(adv_estimator="gtpo", gtpo={"conflict_mask": True}) == (ENTROPY, RESPONSES)
    assert needed(adv_estimator="gtpo_traj") == (ENTROPY, RESPONSES)
    assert needed(adv_estimator="grpo_s") == (ENTROPY,)
    assert needed(adv_estimator="grpo") == ()
    assert needed(adv_estimator="grpo", forking={"enable": True, "scope": "batch"}) == (ENTROPY,)
    assert needed(adv_estimator="grpo", forking={"enable": True, "scope": "micro_batch"}) == ()
    assert set(FIELDS) == {ENTROPY, RESPONSES}


def test_add_refuses_a_taken_name_estimator_or_block():
    row = METHODS["gtpo"]
    with pytest.raises(ValueError, match="already a row"):
        methods.add(dataclasses.replace(row, paper="another"))
    with pytest.raises(ValueError, match="estimator 'gtpo' is 'gtpo'"):
        methods.add(Method("gtpo2", "-", adv_estimator="gtpo", advantages=lambda **_: None))
    with pytest.raises(ValueError, match="algorithm.grpo_s is read by another dataclass"):
        methods.add(Method("other", "-", adv_estimator="other", knobs="grpo_s", params=KNOBS["gtpo"]))
    with pytest.raises(ValueError, match="needs \\['logits'\\]"):
        Method("bad", "-", adv_estimator="bad", needs=("logits",))
    assert set(METHODS) == {"grpo", "dapo", "dapo_forking", "gtpo", "grpo_s", "gtpo_traj"}


def _method_name_lists(tree: ast.AST) -> list[int]:
    """Lines of literal lists, tuples, sets and dict keys naming two or more of the table's methods."""
    names = set(METHODS) - {"grpo"}  # "grpo" is also verl's estimator, named wherever verl's are listed
    found = []
    for node in ast.walk(tree):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and items:
            named = {item.value for item in items if isinstance(item, ast.Constant) and item.value in names}
            if len(named) >= 2:
                found.append(node.lineno)
    return found


def test_the_method_names_are_listed_in_one_place():
    """No module of the package or the entry point keeps its own list of methods: they read the table."""
    lists = {}
    for path in [*(REPO_ROOT / "gtpo").rglob("*.py"), *(REPO_ROOT / "recipe").rglob("*.py")]:
        if path.name == "methods.py" and path.parent.name == "gtpo":
            continue
        lines = _method_name_lists(ast.parse(path.read_text(encoding="utf-8")))
        if lines:
            lists[str(path.relative_to(REPO_ROOT))] = lines
    assert lists == {}


def test_the_list_check_sees_a_list():
    assert _method_name_lists(ast.parse('X = frozenset({"gtpo", "grpo_s"})')) == [1]
    assert _method_name_lists(ast.parse('X = {"gtpo": 1, "gtpo_traj": 2}')) == [1]
    assert _method_name_lists(ast.parse('X = ("gtpo", "verl")')) == []


def test_a_row_added_outside_the_package_is_registered_and_runs():
    """The toy method of tests/support/toy_method.py (a row and its file): in verl's registry through the one adapter,
    with its knob block read and the entropy it needs checked (in a fresh interpreter: the table is process-wide)."""
    code = """
import numpy as np, torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
import tests.support.toy_method as toy
from gtpo.methods import KNOBS, METHODS, fields_needed

assert METHODS["toy"] is toy.TOY and KNOBS["toy"] is toy.ToyParams
assert fields_needed(OmegaConf.create({"adv_estimator": "toy"})) == ("entropy",)
fn = get_adv_estimator_fn("toy")
mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
tlr = torch.zeros(4, 3)
tlr[torch.arange(4), mask.sum(-1).long() - 1] = torch.tensor([1.0, -1.0, 1.0, 1.0])
entropy = torch.tensor([[1.0, 2.0, 9.0], [1.0, 1.0, 1.0], [2.0, 9.0, 9.0], [1.0, 1.0, 1.0]])
index = np.array(["a", "a", "b", "b"], dtype=object)
metrics = {}
adv, ret = fn(tlr, mask, index, OmegaConf.create({"toy": {"scale": 0.5}}), entropy=entropy, metrics=metrics)
mean_h = 11.0 / 9.0  # the valid tokens: 1 + 2, 1 + 1 + 1, 2, 1 + 1 + 1
expected = torch.tensor([1.0, -1.0, 0.0, 0.0])[:, None] * (1 + 0.5 * (entropy / mean_h - 1)) * mask
torch.testing.assert_close(adv, expected)
assert metrics["toy/mean_entropy"] == mean_h
try:
    fn(tlr, mask, index, OmegaConf.create({"toy": {"scale": -1}}), entropy=entropy)
except ValueError as err:
    assert "algorithm.toy.scale=-1" in str(err), err
else:
    raise AssertionError("a negative scale was accepted")
try:
    fn(tlr, mask, index, OmegaConf.create({}))
except ValueError as err:
    assert "needs entropy, got entropy=None" in str(err), err
else:
    raise AssertionError("a call without entropy was accepted")
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
