"""A bad value stops the run before Ray starts, in one line naming the key (or the file) and what is valid.

    .venv/bin/python -m pytest -q -n 0 tests/test_bad_values.py

The inputs are the security review's (round 2, rows 50-65 and 78): configuration values verl accepted (negative or
string step counts, no epochs, NaN / infinite / negative learning rates, a NaN clip ratio, ``rollout.n=1e8``, an
int64 token budget), data it read only after every worker had started (missing, garbage, truncated, empty or
column-less parquet files, prompts stored as bytes, prompts longer than ``data.max_prompt_length`` under
``data.truncation=error``) and a grader call that took 30 x its time limit for one response.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gtpo.launch.checks import check_config
from gtpo.launch.data_checks import DataError, check_data
from tests.support.configs import REPO_ROOT, compose, data_overrides

INT64_MAX = 2**63 - 1


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.total_training_steps=-5", "trainer.total_training_steps=-5: must be an integer >= 1 or null"),
        ("trainer.total_training_steps=0", "trainer.total_training_steps=0: must be an integer >= 1 or null"),
        ("trainer.total_training_steps=abc", "trainer.total_training_steps='abc': must be an integer >= 1 or null"),
        ("trainer.total_training_steps=2.5", "trainer.total_training_steps=2.5: must be an integer >= 1 or null"),
        ("trainer.total_epochs=0", "trainer.total_epochs=0: must be an integer >= 1"),
        ("actor_rollout_ref.actor.optim.lr=nan", "actor_rollout_ref.actor.optim.lr=nan: must be a finite number > 0"),
        ("actor_rollout_ref.actor.optim.lr=inf", "actor_rollout_ref.actor.optim.lr=inf: must be a finite number > 0"),
        ("actor_rollout_ref.actor.optim.lr=-1", "actor_rollout_ref.actor.optim.lr=-1: must be a finite number > 0"),
        ("actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.optim.lr=0: must be a finite number > 0"),
        ("critic.optim.lr=nan", "critic.optim.lr=nan: must be a finite number > 0"),
        (
            "actor_rollout_ref.actor.clip_ratio_high=nan",
            "actor_rollout_ref.actor.clip_ratio_high=nan: must be a finite number in (0, 1]",
        ),
        (
            "actor_rollout_ref.actor.clip_ratio_low=-0.2",
            "actor_rollout_ref.actor.clip_ratio_low=-0.2: must be a finite number in (0, 1]",
        ),
        ("actor_rollout_ref.actor.clip_ratio=1.5", "actor_rollout_ref.actor.clip_ratio=1.5: must be a finite number"),
        ("actor_rollout_ref.actor.clip_ratio_c=1.0", "actor_rollout_ref.actor.clip_ratio_c=1.0: must be a finite"),
        ("critic.cliprange_value=inf", "critic.cliprange_value=inf: must be a finite number in (0, 1]"),
        (
            "actor_rollout_ref.rollout.n=100000000",
            "actor_rollout_ref.rollout.n=100000000: must be an integer in [1, 1048576]",
        ),
        ("actor_rollout_ref.rollout.n=1e8", "actor_rollout_ref.rollout.n=100000000.0: must be an integer in [1,"),
        (
            "actor_rollout_ref.rollout.n=100000",
            "data.train_batch_size=32 x actor_rollout_ref.rollout.n=100000 = 3200000 sequences per step: must be at",
        ),
        (
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={INT64_MAX}",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={INT64_MAX}: must be an integer in [1, 2147483647]",
        ),
        (
            f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={INT64_MAX}",
            "log_prob_max_token_len_per_gpu=9223372036854775807: must be an integer in [1, 2147483647]",
        ),
        ("trainer.total_training_steps=true", "trainer.total_training_steps=True: must be an integer >= 1 or null"),
        (
            f"critic.ppo_max_token_len_per_gpu={INT64_MAX}",
            f"critic.ppo_max_token_len_per_gpu={INT64_MAX}: must be an integer in [1, 2147483647]",
        ),
        (
            f"critic.forward_max_token_len_per_gpu={INT64_MAX}",
            f"critic.forward_max_token_len_per_gpu={INT64_MAX}: must be an integer in [1, 2147483647]",
        ),
    ],
)
def test_a_value_no_run_can_train_with_is_refused_naming_its_key(override, message):
    with pytest.raises(ValueError) as err:
        check_config(compose(["backend=cpu_tiny", "data.train_batch_size=32", override]))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_presets_pass():
    for overrides in (["method=gtpo", "model=qwen2.5_7b"], ["method=dapo", "model=qwen2.5_32b"], ["backend=cpu_tiny"]):
        check_config(compose(overrides))


def test_the_entry_point_says_it_in_one_line_with_exit_2():
    """``DRY_RUN=1 python -m recipe.gtpo.main_gtpo backend=cpu_tiny trainer.total_training_steps=abc``: exit 2, one
    line, before the resolved config is printed (verl's ``int()`` named no key, 1,200 lines later)."""
    env = {**os.environ, "DRY_RUN": "1"}
    env.pop("GTPO_TRACEBACK", None)
    proc = subprocess.run(
        [sys.executable, "-m", "recipe.gtpo.main_gtpo", "backend=cpu_tiny", "trainer.total_training_steps=abc"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("gtpo:")]
    assert said == ["gtpo: invalid configuration: trainer.total_training_steps='abc': must be an integer >= 1 or null"]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# ------------------------------------------------------------------------------------------------------- data


def rows(n: int, prompt=lambda i: [{"role": "user", "content": f"say {i % 10}"}]) -> dict:
    return {
        "data_source": ["toy"] * n,
        "prompt": [prompt(i) for i in range(n)],
        "reward_model": [{"style": "rule", "ground_truth": str(i % 10)} for i in range(n)],
    }


def write(path: Path, table: pa.Table) -> Path:
    pq.write_table(table, path)
    return path


def plant_garbage(path: Path) -> None:
    path.write_bytes(b"\x00garbage, not parquet" * 100)


def plant_truncated(path: Path) -> None:
    data = write(path, pa.table(rows(50))).read_bytes()
    path.write_bytes(data[: len(data) // 2])


def plant_empty(path: Path) -> None:
    write(path, pa.table(rows(0), schema=pa.table(rows(1)).schema))


def plant_no_prompt(path: Path) -> None:
    table = pa.table(rows(4))
    write(path, table.drop_columns(["prompt"]))


def plant_binary_prompt(path: Path) -> None:
    """Non-UTF-8 bytes as the prompt's content (review row 64: trained on empty prompts)."""
    schema = pa.struct([("role", pa.string()), ("content", pa.binary())])
    prompts = pa.array([[{"role": "user", "content": b"\xff\xfe say 5"}]] * 4, type=pa.list_(schema))
    write(path, pa.table({**rows(4), "prompt": prompts}))


def plant_string_prompt(path: Path) -> None:
    write(path, pa.table(rows(4, prompt=lambda i: f"say {i}")))


def plant_no_ground_truth(path: Path) -> None:
    write(path, pa.table({**rows(4), "reward_model": [{"style": "rule"}] * 4}))


def plant_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def plant_no_data_source(path: Path) -> None:
    write(path, pa.table(rows(4)).drop_columns(["data_source"]))


PLANTS = {
    "missing": (lambda path: path.unlink(), "does not exist"),
    "garbage": (plant_garbage, "is not a readable parquet file (ArrowInvalid: "),
    "truncated": (plant_truncated, "is not a readable parquet file (ArrowInvalid: "),
    "no-rows": (plant_empty, "has no rows"),
    "no-prompt-column": (plant_no_prompt, "has no column prompt (data.prompt_key=prompt"),
    "binary-prompt": (plant_binary_prompt, "row 0 of column prompt holds a message content stored as bytes"),
    "string-prompt": (plant_string_prompt, "row 0 of column prompt holds a str, not a non-empty list"),
    "no-ground-truth": (plant_no_ground_truth, "row 0 of column reward_model has no ground_truth"),
    "a-folder": (plant_folder, "is not a file"),
    "no-data-source": (plant_no_data_source, "has no column data_source"),
}


@pytest.mark.parametrize("plant", list(PLANTS), ids=list(PLANTS))
@pytest.mark.parametrize("which", ["train", "val"])
def test_data_verl_would_fail_on_or_misread_is_refused_naming_the_file(tmp_path, plant, which):
    """Review rows 59-64: each a traceback after 45-135 s of start-up, or a silently wrong run."""
    data = data_overrides(tmp_path)
    cfg = compose(["backend=cpu_tiny", *data])
    path = tmp_path / f"{which}.parquet"
    make, why = PLANTS[plant]
    make(path)
    key = "data.train_files" if which == "train" else "data.val_files"
    with pytest.raises(DataError) as err:
        check_data(cfg)
    assert str(err.value).startswith(f"{key}: {path}") and why in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


@pytest.fixture
def tokenizer_dir(tmp_path) -> Path:
    """The CPU demo's word-level tokenizer and chat template, saved as a model folder's tokenizer."""
    from gtpo.cpu.demo_task import build_tokenizer

    folder = tmp_path / "model"
    build_tokenizer().save_pretrained(folder)
    return folder


def test_a_prompt_longer_than_the_limit_is_refused_under_truncation_error(tmp_path, tokenizer_dir):
    """Review row 65: 1 MB prompts cut to their last tokens and trained on although ``data.truncation=error``."""
    long_words = " ".join(["say"] * 4000)

    def prompt(i: int) -> list:
        return [{"role": "user", "content": long_words if i == 5 else "say 1"}]

    write(tmp_path / "train.parquet", pa.table(rows(8, prompt=prompt)))
    write(tmp_path / "val.parquet", pa.table(rows(4)))
    base = ["backend=cpu_tiny", f"data.train_files={tmp_path / 'train.parquet'}",
            f"data.val_files={tmp_path / 'val.parquet'}", f"actor_rollout_ref.model.path={tokenizer_dir}",
            "data.max_prompt_length=64"]  # fmt: skip
    with pytest.raises(DataError) as err:
        check_data(compose([*base, "data.truncation=error"]))
    assert f"data.train_files: {tmp_path / 'train.parquet'}: row 5's prompt is " in str(err.value)
    assert "tokens > data.max_prompt_length=64 with data.truncation=error" in str(err.value)
    # a limit the prompts fit, truncation by design (the presets' left), or verl's own filter: accepted
    assert check_data(compose([*base[:-1], "data.max_prompt_length=8192", "data.truncation=error"]))
    assert check_data(compose([*base, "data.truncation=left"]))
    assert check_data(compose([*base, "data.truncation=error", "data.filter_overlong_prompts=true"]))


def test_the_driver_checks_the_data_of_a_real_run_before_ray(tmp_path, monkeypatch):
    """``prepare_config`` of a real run (what runs before verl's ``run_ppo``); a dry run, which may run where the
    data are not mounted, does not read them."""
    import gtpo.verl_plugin.register  # noqa: F401
    from recipe.gtpo.main_gtpo import prepare_config

    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)
    # backend=cpu_tiny's device stays cpu whatever platform verl detected first in this process (CUDA's, alone)
    monkeypatch.setattr("recipe.gtpo.main_gtpo.auto_set_device", lambda config: None)
    data = data_overrides(tmp_path)
    plant_garbage(tmp_path / "val.parquet")
    prepare_config(compose(["backend=cpu_tiny", *data]), dry_run=True)
    with pytest.raises(DataError, match="data.val_files: .*val.parquet is not a readable parquet file"):
        prepare_config(compose(["backend=cpu_tiny", *data]))


# ----------------------------------------------------------------------------------------------------- grader


def test_one_responses_grading_is_bounded_whatever_its_number_of_golds(monkeypatch):
    """Review row 78: 30 slow golds took 30 x the limit for one response. Now the golds share the response's
    ``timeout_s``: each call gets what is left, and once it is spent no further gold is tried. A clock of the test's
    own advances by what each call is given (a slow gold uses all of it)."""
    from gtpo.reward import math as reward

    now = [1000.0]
    monkeypatch.setattr(reward.time, "monotonic", lambda: now[0])
    given = []

    def slow(gold, text, seconds):
        given.append(seconds)
        now[0] += min(seconds, 1.5)  # each gold takes 1.5 s, or the whole budget left
        return (False, "timeout") if seconds <= 1.5 else (False, "incorrect")

    def slow_response(gold, text, seconds):
        return (*slow(gold, text, seconds), "")

    golds = [f"{i}+1" for i in range(30)]
    result = reward._score_one(r"\boxed{5}", golds, (1.0, -1.0), "strict", slow, slow_response, 4.0)
    assert given == [4.0, 2.5, 1.0] and result["grade_status"] == "timeout" and result["score"] == -1.0
    # lenient: the strict pass and the lenient pass share it too
    given.clear()
    reward._CACHE.clear()
    result = reward._score_one(r"\boxed{5}", ["7", "8"], (1.0, -1.0), "lenient", slow, slow_response, 4.0)
    assert given == [4.0, 2.5, 1.0, 0.0][:3] and result["grade_status"] == "timeout"


def test_the_pooled_grader_spends_one_budget_on_30_slow_golds():
    """The real pool: 30 golds that each take the full limit (a power tower) are one call, not thirty."""
    from gtpo.reward import math as reward
    from gtpo.reward.pool import get_pool

    pool = get_pool(2)
    calls = []
    original = pool.grade

    def counted(gold, pred, timeout_s=10.0, **kwargs):
        calls.append(timeout_s)
        return original(gold, pred, timeout_s=timeout_s, **kwargs)

    pool.grade = counted
    try:
        tower = r"\dfrac{5^{(5^{(5^{(5^5)})}-4)}-5}{16}"  # tests/test_reward_math.py's: compared, it takes any limit
        t0 = time.monotonic()
        result = reward.compute_score("d", r"\boxed{5}", [f"{tower}+{i}" for i in range(30)], timeout_s=2)
    finally:
        del pool.grade
    assert result["grade_status"] == "timeout" and len(calls) == 1 and calls[0] <= 2, (calls, time.monotonic() - t0)


def test_the_sequences_of_a_step_may_reach_the_bound():
    """``data.train_batch_size x rollout.n`` equal to the bound (2**20) is accepted; one prompt more is not."""
    from gtpo.launch.value_checks import MAX_SEQUENCES_PER_STEP, check_run_values

    n = MAX_SEQUENCES_PER_STEP // 32
    check_run_values(compose(["backend=cpu_tiny", "data.train_batch_size=32", f"actor_rollout_ref.rollout.n={n}"]))
    with pytest.raises(ValueError, match=f"data.train_batch_size=33 x actor_rollout_ref.rollout.n={n} = "):
        check_run_values(compose(["backend=cpu_tiny", "data.train_batch_size=33", f"actor_rollout_ref.rollout.n={n}"]))


def test_a_prompt_is_refused_from_one_token_over_the_limit(tmp_path, tokenizer_dir):
    """The bound is exact: a prompt of exactly ``data.max_prompt_length`` tokens (as the chat template renders it)
    passes, one limit lower it is refused, naming its length."""
    from transformers import AutoTokenizer

    prompt = [{"role": "user", "content": " ".join(["say"] * 40)}]
    ids = AutoTokenizer.from_pretrained(tokenizer_dir).apply_chat_template(prompt, add_generation_prompt=True)
    length = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    write(tmp_path / "train.parquet", pa.table(rows(4, prompt=lambda i: prompt)))
    write(tmp_path / "val.parquet", pa.table(rows(4)))
    base = ["backend=cpu_tiny", f"data.train_files={tmp_path / 'train.parquet'}",
            f"data.val_files={tmp_path / 'val.parquet'}", f"actor_rollout_ref.model.path={tokenizer_dir}",
            "data.truncation=error"]  # fmt: skip
    assert check_data(compose([*base, f"data.max_prompt_length={length}"]))
    with pytest.raises(DataError, match=f"row 0's prompt is {length} tokens > data.max_prompt_length={length - 1}"):
        check_data(compose([*base, f"data.max_prompt_length={length - 1}"]))
