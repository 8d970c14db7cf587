"""CPU demo: verl's real trainer teaches a randomly initialised tiny model the toy task ``say <d>`` -> ``<d>`` by RL.

    python -m gtpo.cpu.demo                                  # GTPO (the recipe's default estimator)
    python -m gtpo.cpu.demo --method grpo --out outputs/cpu_demo/grpo
    python -m gtpo.cpu.demo --steps 60 -- actor_rollout_ref.actor.optim.lr=2e-3   # Hydra overrides after ``--``

Task: prompt ``say <d>`` with ``d`` in 0..9; reward 1 if the first
whitespace-separated word of the response is ``d``, else 0. GTPO (arXiv 2508.04349) counts a response as correct when
its reward is ``> 0`` and uses the literal -1 as the negative base (Eq. 5), so the 0/1 reward needs no rescaling.
The data set is the ten prompts repeated, so the demo shows that the reward signal flows through verl (rollout,
reward, estimator, PPO update, weight sync), not generalisation.

Assets (built offline into ``$GTPO_CACHE_DIR`` or ``~/.cache/gtpo/tiny``, one folder per recipe hash and seed):

* a word-level tokenizer (``tokenizers`` ``WordLevel`` + whitespace split) of 43 tokens: pad ``<|endoftext|>``,
  ``<|im_start|>``, eos ``<|im_end|>``, ``<unk>``, ``"\\n"``, ``say``, the digits, the number words and filler words.
  ``"\\n"`` is an added token so that it encodes to exactly one id: verl 0.9.1 picks its Qwen continuous-token
  builder from ``model_type=qwen2`` and that builder rejects a tokenizer where it does not (every rollout would
  fail). The chat template renders the user content only, so prompt ids are exactly ``[say, d]``. The tokenizer
  lives in its own folder and is passed as ``actor_rollout_ref.model.tokenizer_path``: transformers 5 replaces a
  tokenizer saved next to a Qwen2 ``config.json`` by a byte-level one rebuilt from the vocabulary.
* a random ``Qwen2ForCausalLM`` (hidden 64, 2 layers, 4 heads / 2 KV heads, intermediate 128, tied embeddings,
  ``vocab_size`` = tokenizer size, float32; ~77k parameters), initialised with ``--seed``;
* ``train.parquet`` (the ten prompts, each repeated 100 times) and ``val.parquet`` (each prompt once).

The trainer is ``python -m recipe.gtpo.main_gtpo backend=cpu_tiny`` plus :func:`demo_overrides` (8 prompts x 16
samples per step, responses of at most 4 tokens, learning rate 1e-3, 4 PPO updates per step, token-mean loss,
clip 0.2, no KL, no dynamic sampling, no validation), run with :func:`gtpo.cpu.env` in a subprocess from the
repository root. Afterwards the demo draws the training curves and a token heatmap with ``python -m gtpo.viz`` and
prints the mean reward of the first and the last ten steps.

Deliberate choices:

* 16 samples per prompt: the random model starts at a reward of ~0.05, so with 8 samples most groups are all wrong
  and carry no signal; 16 samples learn about 1.5x faster per step and far less seed-dependently, for a small
  cost per step.
* ``--method`` selects ``configs/method/<m>.yaml`` when that preset exists, else sets
  ``algorithm.adv_estimator=<m>``; the demo's own settings come after it on the command line, so a preset cannot
  change the task or the budget (DAPO dynamic sampling, clip-higher, KL loss and loss aggregation are pinned) and
  runs of different methods stay comparable.
* The reward never raises on odd responses (empty, special tokens only): they simply score 0.
* The token heatmap shows the step whose batch reward is closest to 0.5 (``--heatmap-step`` picks another): late in
  a run every group is all-correct and GRPO's advantages are all 0.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

DEMO_VERSION = 1
DATA_SOURCE = "cpu_demo/say_digit"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|endoftext|>", "<|im_end|>", "<unk>"
NEWLINE = "\n"
DIGITS = tuple(str(d) for d in range(10))
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
FILLER_WORDS = tuple("the a is and of to it yes no ok i you what number answer = .".split())
# Word-level vocabulary in id order; "\n" is appended last as an added token (see module docstring).
WORDS = ("say", *DIGITS, *NUMBER_WORDS, *FILLER_WORDS)
CHAT_TEMPLATE = "{%- for message in messages %}{{- message['content'] }}{%- endfor %}"

MODEL_RECIPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
DATA_RECIPE = dict(repeats=100, val_repeats=1)

# Trainer settings of the demo, appended after backend=cpu_tiny and the method preset so that every method runs the
# same task with the same budget: the presets' DAPO dynamic sampling (it would also bias the logged training reward
# towards mixed groups), clip-higher, KL loss and loss aggregation are pinned to one setting.
DEMO_SETTINGS: tuple[str, ...] = (
    "data.train_batch_size=8",
    "data.max_prompt_length=8",
    "data.max_response_length=4",
    "data.filter_overlong_prompts=False",
    "data.truncation=error",
    "data.dataloader_num_workers=0",
    "actor_rollout_ref.rollout.n=16",
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.top_p=1.0",
    "actor_rollout_ref.rollout.top_k=-1",
    "actor_rollout_ref.rollout.response_length=4",
    "actor_rollout_ref.rollout.prompt_length=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=128",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.actor.ppo_epochs=1",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=128",
    "algorithm.use_kl_in_reward=False",
    "algorithm.filter_groups.enable=False",
    "reward.custom_reward_function.path=pkg://gtpo.cpu.demo",
    "reward.custom_reward_function.name=compute_score",
    "trainer.total_epochs=1000",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.val_before_train=False",
    "trainer.logger=[console,file]",
    "trainer.project_name=gtpo_cpu_demo",
)

# Per-method demo settings, appended after DEMO_SETTINGS.
METHOD_SETTINGS: dict[str, tuple[str, ...]] = {}

REWARD_KEY = "critic/score/mean"


# ----------------------------------------------------------------------------------------------------------------
# reward


def score_response(response: str, target: str) -> float:
    """1.0 if the first whitespace-separated word of ``response`` equals ``target`` (stripped), else 0.0."""
    words = response.split()
    return 1.0 if words and words[0] == str(target).strip() else 0.0


def compute_score(data_source=None, solution_str: str = "", ground_truth: str = "", extra_info=None, **kwargs) -> float:
    """verl custom reward (``reward.custom_reward_function``): the demo's 0/1 reward of a decoded response."""
    if solution_str is None:
        return 0.0
    return score_response(str(solution_str), str(ground_truth))


# ----------------------------------------------------------------------------------------------------------------
# assets


@dataclass(frozen=True)
class DemoAssets:
    """Paths of the built demo assets (all absolute)."""

    model_dir: str
    tokenizer_dir: str
    train_parquet: str
    val_parquet: str


def build_tokenizer():
    """The demo's word-level tokenizer as a transformers fast tokenizer (43 tokens, ``"\\n"`` is one token)."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *WORDS))}
    core = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # An added token is matched before the whitespace pre-tokenizer would drop it.
    core.add_tokens([AddedToken(NEWLINE, special=False, normalized=False)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=UNK_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(vocab_size: int, seed: int, pad_token_id: int, eos_token_id: int):
    """Random tiny ``Qwen2ForCausalLM`` (float32) initialised from ``seed``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        torch_dtype="float32",
        **MODEL_RECIPE,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    return model


def build_rows(repeats: int, split: str) -> list[dict]:
    """verl RL rows: the ten prompts ``say <d>`` in order 0..9, the block repeated ``repeats`` times."""
    rows = []
    for r in range(repeats):
        for d in DIGITS:
            rows.append(
                {
                    "data_source": DATA_SOURCE,
                    "prompt": [{"role": "user", "content": f"say {d}"}],
                    "ability": "toy",
                    "reward_model": {"style": "rule", "ground_truth": d},
                    "extra_info": {"split": split, "index": r * len(DIGITS) + int(d)},
                }
            )
    return rows


def recipe_key(seed: int) -> str:
    """Hash of everything the assets are built from (recipe constants, seed, library versions)."""
    import tokenizers
    import transformers

    blob = json.dumps(
        {
            "version": DEMO_VERSION,
            "tokens": [*SPECIAL_TOKENS, *WORDS, NEWLINE],
            "template": CHAT_TEMPLATE,
            "model": MODEL_RECIPE,
            "data": DATA_RECIPE,
            "seed": seed,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    return Path(os.environ.get("GTPO_CACHE_DIR") or Path.home() / ".cache" / "gtpo" / "tiny")


def _assets_in(folder: Path) -> DemoAssets:
    return DemoAssets(
        model_dir=str(folder / "model"),
        tokenizer_dir=str(folder / "tokenizer"),
        train_parquet=str(folder / "data" / "train.parquet"),
        val_parquet=str(folder / "data" / "val.parquet"),
    )


def _build_into(folder: Path, seed: int) -> None:
    import pandas as pd

    tok = build_tokenizer()
    tok.save_pretrained(folder / "tokenizer")
    model = build_model(len(tok), seed, tok.pad_token_id, tok.eos_token_id)
    model.save_pretrained(folder / "model", safe_serialization=True)
    (folder / "data").mkdir()
    pd.DataFrame(build_rows(DATA_RECIPE["repeats"], "train")).to_parquet(folder / "data" / "train.parquet", index=False)
    pd.DataFrame(build_rows(DATA_RECIPE["val_repeats"], "test")).to_parquet(
        folder / "data" / "val.parquet", index=False
    )
    (folder / "RECIPE.json").write_text(
        json.dumps({"version": DEMO_VERSION, "seed": seed, "model": MODEL_RECIPE, "data": DATA_RECIPE}, indent=1)
    )


def build_demo_assets(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> DemoAssets:
    """Build (once per recipe hash and seed) and return the demo assets; safe to call concurrently."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: must be a non-negative int")
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"cpu-demo-{recipe_key(seed)}"
    if (final / "RECIPE.json").is_file():
        return _assets_in(final)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (final / "RECIPE.json").is_file():
                return _assets_in(final)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
            try:
                _build_into(tmp, seed)
                if final.exists():
                    # Left by an interrupted build (no RECIPE.json, so incomplete).
                    shutil.rmtree(final)
                os.rename(tmp, final)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return _assets_in(final)


# ----------------------------------------------------------------------------------------------------------------
# trainer command


def method_overrides(method: str) -> list[str]:
    """``method=<m>`` when ``configs/method/<m>.yaml`` exists, else ``algorithm.adv_estimator=<m>``."""
    if not method or not all(c.isalnum() or c in "_-." for c in method):
        raise ValueError(f"method={method!r}: expected a preset or estimator name such as gtpo or grpo")
    if (REPO_ROOT / "configs" / "method" / f"{method}.yaml").is_file():
        return [f"method={method}"]
    return [f"algorithm.adv_estimator={method}"]


def demo_overrides(
    assets: DemoAssets,
    steps: int,
    seed: int,
    rollout_dir: str | os.PathLike | None = None,
    experiment: str = "demo",
    method: str | None = None,
) -> list[str]:
    """Hydra overrides of the demo run (without ``backend=`` / ``method=``); ``method`` adds its METHOD_SETTINGS."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: must be a positive int")
    out = [
        f"data.train_files={assets.train_parquet}",
        f"data.val_files={assets.val_parquet}",
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"actor_rollout_ref.model.path={assets.model_dir}",
        f"actor_rollout_ref.model.tokenizer_path={assets.tokenizer_dir}",
        *DEMO_SETTINGS,
        *METHOD_SETTINGS.get(method or "", ()),
        f"trainer.total_training_steps={steps}",
        f"trainer.experiment_name={experiment}",
    ]
    if rollout_dir is not None:
        out.append(f"trainer.rollout_data_dir={rollout_dir}")
    return out


def trainer_command(method: str, overrides: list[str], metrics_path: str | os.PathLike, extra: list[str]) -> list[str]:
    """Full command line of the trainer subprocess (run it from the repository root)."""
    return [
        sys.executable,
        "-m",
        "recipe.gtpo.main_gtpo",
        "backend=cpu_tiny",
        *method_overrides(method),
        *overrides,
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics_path}",
        *extra,
    ]


def trainer_env() -> dict[str, str]:
    """This process's environment plus the CPU backend's variables."""
    from gtpo.cpu import env as cpu_env

    env = dict(os.environ)
    env.update(cpu_env())
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("WANDB_MODE", "disabled")
    return env


# ----------------------------------------------------------------------------------------------------------------
# results


def load_rewards(metrics_path: str | os.PathLike, key: str = REWARD_KEY) -> list[tuple[int, float]]:
    """``[(step, mean reward)]`` from verl's file-logger JSONL (a truncated last line is skipped)."""
    path = Path(metrics_path)
    if not path.is_file():
        return []
    by_step: dict[int, float] = {}
    for rec, data in file_logger_records(path):
        value = data.get(key) if isinstance(data, dict) else None
        if isinstance(value, int | float) and math.isfinite(value):
            by_step[int(rec["step"])] = float(value)
    return sorted(by_step.items())


def file_logger_records(path: Path) -> Iterator[tuple[dict, object]]:
    """``(record, data)`` per parseable line of verl's file-logger JSONL; a line still being written is skipped."""
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        yield rec, rec.get("data", rec)


def summarize(rewards: list[tuple[int, float]], window: int = 10, target: float = 0.8) -> dict:
    """Mean reward of the first / last ``window`` steps and the first step whose trailing window mean >= target."""
    values = [v for _, v in rewards]
    if not values:
        return {"steps": 0}
    w = min(window, len(values))
    reached = None
    for i in range(window - 1, len(values)):
        if sum(values[i - window + 1 : i + 1]) / window >= target:
            reached = rewards[i][0]
            break
    return {
        "steps": len(values),
        "window": w,
        "first_mean": sum(values[:w]) / w,
        "last_mean": sum(values[-w:]) / w,
        "target": target,
        "step_reaching_target": reached,
    }


def token_dumps(rollout_dir: Path) -> dict[int, Path]:
    """``{step: path}`` of the ``tokens_<step>.jsonl`` dumps in ``rollout_dir``."""
    found: dict[int, Path] = {}
    for p in rollout_dir.glob("tokens_*.jsonl"):
        suffix = p.stem.split("_", 1)[1]
        if suffix.isdigit():
            found[int(suffix)] = p
    return found


def latest_token_dump(rollout_dir: Path) -> Path | None:
    """The ``tokens_<step>.jsonl`` with the highest step in ``rollout_dir``, if any."""
    dumps = token_dumps(rollout_dir)
    return dumps[max(dumps)] if dumps else None


def heatmap_step(rewards: list[tuple[int, float]], available: set[int]) -> int | None:
    """The latest available step whose batch reward is closest to 0.5 (most groups mix correct and wrong samples).

    Late in a run every group is all-correct: GRPO's advantages are then all 0 and the picture shows nothing.
    Falls back to the latest available step when no reward is known for any of them.
    """
    known = [(s, v) for s, v in rewards if s in available]
    if not known:
        return max(available) if available else None
    return min(known, key=lambda sv: (abs(sv[1] - 0.5), -sv[0]))[0]


def _run_viz(args: list[str], env: dict[str, str]) -> bool:
    proc = subprocess.run(
        [sys.executable, "-m", "gtpo.viz", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        print(f"[demo] gtpo.viz {args[0]} failed (rc={proc.returncode}):\n{proc.stderr.strip()}", file=sys.stderr)
    return proc.returncode == 0


def make_plots(
    out: Path,
    name: str,
    metrics_path: Path,
    rollout_dir: Path,
    tokenizer_dir: str,
    also_plot: list[str],
    step: int | None = None,
) -> dict[str, object]:
    """Curves PNG and a token heatmap (HTML + PNG) of the run; returns what was written.

    The heatmap shows ``tokens_<step>.jsonl`` (per-token advantages) for ``step``, by default :func:`heatmap_step`;
    without token dumps it falls back to verl's text dump of that step, coloured by score.
    """
    env = dict(os.environ)
    env.setdefault("MPLBACKEND", "Agg")
    written: dict[str, object] = {}
    rewards = load_rewards(metrics_path)
    if metrics_path.is_file():
        runs = [arg for spec in [f"{name}={metrics_path}", *also_plot] for arg in ("--run", spec)]
        curves = out / "curves.png"
        panels = ["--metrics", REWARD_KEY, "actor/entropy"]
        if _run_viz(["curves", *runs, *panels, "--out", str(curves), "--title", "CPU demo: say <d> -> <d>"], env):
            written["curves"] = str(curves)
    if not rollout_dir.is_dir():
        return written
    heat = out / "heatmap"
    dumps = token_dumps(rollout_dir)
    if dumps:
        pick = step if step is not None else heatmap_step(rewards, set(dumps))
        if pick in dumps and _run_viz(
            [
                "tokens",
                "--input",
                str(dumps[pick]),
                "--out",
                str(heat),
                "--color",
                "advantage",
                "--tokenizer",
                tokenizer_dir,
                "--max-prompts",
                "4",
            ],
            env,
        ):
            written.update(heatmap=str(heat), heatmap_step=pick)
        return written
    text_dumps = {int(p.stem): p for p in rollout_dir.glob("*.jsonl") if p.stem.isdigit()}
    if text_dumps:
        pick = step if step is not None else heatmap_step(rewards, set(text_dumps))
        # verl's own text dumps carry only the sequence score.
        if pick in text_dumps and _run_viz(
            [
                "tokens",
                "--input",
                str(text_dumps[pick]),
                "--out",
                str(heat),
                "--color",
                "score",
                "--tokenizer",
                tokenizer_dir,
                "--max-prompts",
                "4",
            ],
            env,
        ):
            written.update(heatmap=str(heat), heatmap_step=pick)
    return written


# ----------------------------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gtpo.cpu.demo",
        description=__doc__.split("\n")[0],
        epilog="Arguments after `--` are passed to the trainer as Hydra overrides.",
    )
    p.add_argument("--method", default="gtpo", help="method preset or estimator: gtpo (default), grpo, grpo_s, ...")
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--out", default=None, help="output folder (default outputs/cpu_demo/<method>)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data-order seed (default 0)")
    p.add_argument("--timeout", type=float, default=1800.0, help="kill the trainer after this many seconds")
    p.add_argument("--cache-dir", default=None, help="asset cache (default $GTPO_CACHE_DIR or ~/.cache/gtpo/tiny)")
    p.add_argument(
        "--also-plot",
        action="append",
        default=[],
        metavar="NAME=METRICS_JSONL",
        help="overlay another run's metrics on the curves (repeatable)",
    )
    p.add_argument(
        "--heatmap-step",
        type=int,
        default=None,
        help="training step drawn in the token heatmap (default: the step whose reward is closest to 0.5)",
    )
    p.add_argument("--assets-only", action="store_true", help="build the assets, print their paths and exit")
    p.add_argument("--dry-run", action="store_true", help="print the trainer command and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        print(f"error: --steps {args.steps}: must be >= 1", file=sys.stderr)
        return 2

    assets = build_demo_assets(args.cache_dir, seed=args.seed)
    if args.assets_only:
        print(json.dumps(asdict(assets), indent=1))
        return 0

    out = Path(args.out or REPO_ROOT / "outputs" / "cpu_demo" / args.method).expanduser().resolve()
    metrics_path = out / "metrics.jsonl"
    rollout_dir = out / "rollouts"
    log_path = out / "train.log"
    try:
        overrides = demo_overrides(
            assets, args.steps, args.seed, rollout_dir, experiment=f"{args.method}_s{args.seed}", method=args.method
        )
        cmd = trainer_command(args.method, overrides, metrics_path, [f"hydra.run.dir={out / 'hydra'}", *extra])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(" ".join(cmd))
        return 0

    out.mkdir(parents=True, exist_ok=True)
    metrics_path.unlink(missing_ok=True)
    if rollout_dir.is_dir():
        shutil.rmtree(rollout_dir)
    print(f"[demo] method={args.method} steps={args.steps} seed={args.seed}; trainer log: {log_path}", flush=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.run(
                cmd, cwd=REPO_ROOT, env=trainer_env(), stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.monotonic() - t0

    rewards = load_rewards(metrics_path)
    summary = {
        "method": args.method,
        "seed": args.seed,
        "returncode": rc,
        "wall_s": round(wall, 1),
        **summarize(rewards),
    }
    summary.update(
        make_plots(out, args.method, metrics_path, rollout_dir, assets.tokenizer_dir, args.also_plot, args.heatmap_step)
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    print(f"[demo] trainer exit code {rc}, wall time {wall:.0f} s, {summary['steps']} steps logged")
    if summary["steps"]:
        reached = summary["step_reaching_target"]
        print(
            f"[demo] mean reward, first {summary['window']} steps -> last {summary['window']}: "
            f"{summary['first_mean']:.2f} -> {summary['last_mean']:.2f}; "
            + (f"10-step mean >= 0.8 at step {reached}" if reached else "10-step mean never reached 0.8")
        )
    if "curves" in summary:
        print(f"[demo] curves: {summary['curves']}")
    if "heatmap" in summary:
        print(f"[demo] token heatmap of step {summary['heatmap_step']}: {summary['heatmap']}")
    print(f"[demo] metrics: {metrics_path}; summary: {out / 'summary.json'}")
    if rc != 0:
        print(f"[demo] the trainer failed; last lines of {log_path}:", file=sys.stderr)
        print("\n".join(log_path.read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
