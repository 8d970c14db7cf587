"""CPU demo: verl's real trainer teaches a randomly initialised tiny model the toy task ``say <d>`` -> ``<d>`` by RL.

    python -m gtpo.cpu.demo                                  # GTPO (the recipe's default estimator)
    python -m gtpo.cpu.demo --method grpo --out outputs/cpu_demo/grpo
    python -m gtpo.cpu.demo --steps 60 -- actor_rollout_ref.actor.optim.lr=2e-3   # Hydra overrides after ``--``

Task: prompt ``say <d>`` with ``d`` in 0..9; reward 1 if the first whitespace-separated word of the response is ``d``,
else 0 (``--task second_word``: the second word must be ``d``, the first is free; same prompts, model and settings, a
separate asset folder; ``--task tool_lookup``: verl's tool agent loop, the answer only a tool call reveals, its own
tokenizer, data and tool config, :mod:`gtpo.cpu.tool_task`). GTPO (arXiv 2508.04349) counts a response as correct
when its reward is ``> 0`` and uses the literal -1 as the negative base (Eq. 5), so the 0/1 reward needs no
rescaling.
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
* a random ``Qwen2ForCausalLM`` (hidden 64, 2 layers, 2 heads of size 32 / 1 KV head, intermediate 128, tied embeddings,
  ``vocab_size`` = tokenizer size, float32; ~77k parameters), initialised with ``--seed``;
* ``train.parquet`` (the ten prompts, each repeated 100 times) and ``val.parquet`` (each prompt once).

The trainer is ``python -m recipe.gtpo.main_gtpo backend=cpu_tiny`` plus :func:`demo_overrides` (8 prompts x 16
samples per step, responses of at most 4 tokens, learning rate 1e-3, 4 PPO updates per step, token-mean loss,
clip 0.2, no KL, no dynamic sampling, no overlong punishment, no validation), run with :func:`gtpo.cpu.env` in a
subprocess from the repository root. Its output goes to ``<out>/train.log``; the console shows one live line (step /
total, the step's mean reward and policy entropy, elapsed and remaining time, :mod:`gtpo.cpu.demo_progress`).
Afterwards the demo draws the training curves and a token heatmap with ``python -m gtpo.viz`` and prints the mean
reward of the first and the last ten steps. ``python -m gtpo.cpu.compare`` runs methods x seeds of this demo.

Deliberate choices:

* 16 samples per prompt: the random model starts at a reward of ~0.05, so with 8 samples most groups are all wrong
  and carry no signal; 16 samples learn about 1.5x faster per step and far less seed-dependently, for a small
  cost per step.
* ``--method`` selects ``configs/method/<m>.yaml`` when that preset exists (grpo, dapo, dapo_forking, gtpo, grpo_s,
  gtpo_traj), else sets ``algorithm.adv_estimator=<m>``. The demo's own settings (``DEMO_SETTINGS``) come after it
  on the command line and are the same for every method, so a preset cannot change the task or the budget and runs
  of different methods stay comparable. They pin what a preset sets that does not fit a 4-token task: the scale
  preset's batch, lengths, group size, learning rate and mini-batch (so gtpo_traj makes 4 updates per step like the
  others, not one); DAPO's dynamic sampling (``algorithm.filter_groups.enable=False``: it would also bias the
  logged training reward towards mixed groups) and its soft overlong punishment
  (``reward.reward_kwargs.overlong_buffer_cfg.enable=False``: a 1,024-token buffer cannot fit in a 4-token
  response; the recipe's validation rejects it, verl's DAPO reward manager would assert); clip-higher (0.2 / 0.2),
  the KL loss (off: no reference model) and the loss aggregation (token-mean). The estimator, the policy loss, the
  reward manager, the forking-token selection and GROP stay the preset's; every method runs the recipe's defaults
  (no per-method setting in ``METHOD_SETTINGS``).
* A reward worker that fails in its constructor (a reward function that does not load, a reward manager that
  rejects its config) stops the run at start-up with its own error (:mod:`gtpo.trainer.guard.startup_checks`).
* The reward never raises on odd responses (empty, special tokens only): they simply score 0.
* The token heatmap shows the step whose batch reward is closest to 0.5 (``--heatmap-step`` picks another): late in
  a run every group is all-correct and GRPO's advantages are all 0.

Modules: :mod:`gtpo.cpu.demo_task` (task, reward, assets), :mod:`gtpo.cpu.demo_trainer` (trainer overrides and
command), :mod:`gtpo.cpu.demo_results` (rewards, summary, plots), :mod:`gtpo.cpu.demo_progress` (the live line);
this module is the command line and :func:`run_demo`, and re-exports their names
(``reward.custom_reward_function.path=pkg://gtpo.cpu.demo`` loads :func:`compute_score` from here: it scores every
task's rows).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from gtpo.cpu.demo_progress import run_trainer_with_progress
from gtpo.cpu.demo_results import (
    REWARD_KEY,
    file_logger_records,
    heatmap_step,
    latest_token_dump,
    load_rewards,
    make_plots,
    summarize,
    token_dumps,
)
from gtpo.cpu.demo_task import (
    CHAT_TEMPLATE,
    DATA_RECIPE,
    DATA_SOURCE,
    DEFAULT_TASK,
    DEMO_VERSION,
    DIGITS,
    EOS_TOKEN,
    FILLER_WORDS,
    MODEL_RECIPE,
    NEWLINE,
    NUMBER_WORDS,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TASK_WORD_INDEX,
    UNK_TOKEN,
    WORDS,
    DemoAssets,
    build_demo_assets,
    build_model,
    build_rows,
    build_tokenizer,
    check_task,
    recipe_key,
    score_response,
    task_data_source,
)
from gtpo.cpu.demo_task import compute_score as word_task_score
from gtpo.cpu.demo_trainer import (
    DEMO_SETTINGS,
    METHOD_SETTINGS,
    REPO_ROOT,
    demo_overrides,
    lora_overrides,
    method_overrides,
    trainer_command,
    trainer_env,
)
from gtpo.cpu.tool_task import DATA_SOURCE as TOOL_DATA_SOURCE
from gtpo.cpu.tool_task import score as tool_task_score
from gtpo.trainer.guard.watchdog import find_expiry

# The tool task (gtpo.cpu.tool_task): the demo's trainer settings plus verl's tool agent loop.
TOOL_TASK = "tool_lookup"


def compute_score(data_source=None, solution_str: str = "", ground_truth: str = "", extra_info=None, **kwargs) -> float:
    """verl custom reward of every demo task: the tool task's rows (``cpu_demo/tool_lookup``) by
    :func:`gtpo.cpu.tool_task.score`, the word tasks' by :func:`gtpo.cpu.demo_task.compute_score`."""
    if data_source == TOOL_DATA_SOURCE:
        return tool_task_score(solution_str, ground_truth)
    return word_task_score(data_source, solution_str, ground_truth, extra_info, **kwargs)


__all__ = [
    "CHAT_TEMPLATE",
    "DATA_RECIPE",
    "DATA_SOURCE",
    "DEFAULT_TASK",
    "DEMO_SETTINGS",
    "DEMO_VERSION",
    "DIGITS",
    "EOS_TOKEN",
    "FILLER_WORDS",
    "METHOD_SETTINGS",
    "MODEL_RECIPE",
    "NEWLINE",
    "NUMBER_WORDS",
    "PAD_TOKEN",
    "REWARD_KEY",
    "SPECIAL_TOKENS",
    "TASK_WORD_INDEX",
    "UNK_TOKEN",
    "WORDS",
    "DemoAssets",
    "build_demo_assets",
    "build_model",
    "build_parser",
    "build_rows",
    "build_tokenizer",
    "check_task",
    "compute_score",
    "demo_command",
    "demo_overrides",
    "lora_overrides",
    "dry_run",
    "file_logger_records",
    "heatmap_step",
    "latest_token_dump",
    "load_rewards",
    "main",
    "make_plots",
    "method_overrides",
    "recipe_key",
    "run_demo",
    "score_response",
    "summarize",
    "task_data_source",
    "token_dumps",
    "trainer_command",
    "trainer_env",
]

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
    p.add_argument(
        "--task",
        default=DEFAULT_TASK,
        choices=[*TASK_WORD_INDEX, TOOL_TASK],
        help="say_digit (default: the first response word must be the digit), second_word (the second must) or "
        "tool_lookup (verl's tool agent loop: the digit comes only from a tool call, gtpo.cpu.tool_task)",
    )
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
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the run (default 1; more need --ray-address)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="FSDP ranks / vLLM replicas per node (default 1)")
    p.add_argument(
        "--ray-address",
        default=os.environ.get("RAY_ADDRESS") or None,
        help="join this running Ray cluster, e.g. one from `python -m gtpo.cpu.cluster start` (default $RAY_ADDRESS)",
    )
    lora_help = "train LoRA adapters of this rank (alpha = rank, every linear layer) instead of the whole model (0)"
    p.add_argument("--lora-rank", type=int, default=0, help=lora_help)
    p.add_argument("--assets-only", action="store_true", help="build the assets, print their paths and exit")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the trainer command, check it as a launcher's DRY_RUN=1 does (the full config with every "
        "override composed and validated, no Ray) and exit",
    )
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

    if args.task == TOOL_TASK:
        from gtpo.cpu.tool_task import build_tool_task_assets, tool_task_overrides

        assets = build_tool_task_assets(args.cache_dir, seed=args.seed)
        extra = [*tool_task_overrides(assets), *extra]  # after the demo's settings; the caller's still come last
    else:
        assets = build_demo_assets(args.cache_dir, seed=args.seed, task=args.task)
    if args.assets_only:
        print(json.dumps(asdict(assets), indent=1))
        return 0

    run_name = args.method if args.task == DEFAULT_TASK else f"{args.method}_{args.task}"
    if args.lora_rank < 0:
        print(f"error: --lora-rank {args.lora_rank}: must be >= 0 (0: the whole model)", file=sys.stderr)
        return 2
    if args.lora_rank:
        run_name += f"_lora{args.lora_rank}"
        extra = [*lora_overrides(args.lora_rank), *extra]  # the caller's overrides still come last
    out = Path(args.out or REPO_ROOT / "outputs" / "cpu_demo" / run_name).expanduser().resolve()
    try:
        world = {"nnodes": args.nnodes, "gpus_per_node": args.gpus_per_node}
        cmd = demo_command(assets, args.method, args.steps, args.seed, out, extra, args.ray_address, **world)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(" ".join(cmd))
        return dry_run([arg for arg in cmd if arg != f"hydra.run.dir={out / 'hydra'}"], args.ray_address)

    summary = run_demo(
        assets, args.method, args.steps, args.seed, out, extra, timeout=args.timeout, label="demo", plots=True,
        also_plot=args.also_plot, heatmap_step_=args.heatmap_step, ray_address=args.ray_address, **world,
    )  # fmt: skip
    rc, log_path = summary["returncode"], out / "train.log"
    print(f"[demo] trainer exit code {rc}, wall time {summary['wall_s']:.0f} s, {summary['steps']} steps logged")
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
    print(f"[demo] metrics: {out / 'metrics.jsonl'}; summary: {out / 'summary.json'}")
    if rc != 0:
        log_text = log_path.read_text(errors="replace")
        stalled = find_expiry(log_text)
        if stalled:
            print(f"[demo] {stalled}", file=sys.stderr)
        print(f"[demo] the trainer failed; last lines of {log_path}:", file=sys.stderr)
        print("\n".join(log_text.splitlines()[-30:]), file=sys.stderr)
    return 0 if rc == 0 else 1


def demo_command(
    assets: DemoAssets,
    method: str,
    steps: int,
    seed: int,
    out: Path,
    extra: list[str],
    ray_address: str | None = None,
    experiment: str | None = None,
    nnodes: int = 1,
    gpus_per_node: int = 1,
) -> list[str]:
    """The trainer command of one demo run writing into ``out``; ``ray_address`` joins a running Ray cluster, which
    a run of several nodes needs (``python -m gtpo.cpu.cluster start --nodes N``)."""
    overrides = demo_overrides(
        assets, steps, seed, out / "rollouts", experiment=experiment or f"{method}_s{seed}", method=method,
        nnodes=nnodes, gpus_per_node=gpus_per_node,
    )  # fmt: skip
    if ray_address:
        # Joining a cluster: ray.init must not be given resources (the cluster has them).
        joined = ["ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null"]
    elif nnodes > 1:
        raise ValueError(
            f"nnodes={nnodes}: a run of several nodes joins a Ray cluster of that many nodes; on one host start one "
            f"with `python -m gtpo.cpu.cluster start --nodes {nnodes} --gpus-per-node {gpus_per_node}` and pass its "
            "address (--ray-address or RAY_ADDRESS)"
        )
    else:
        # A local Ray node with one logical GPU per rank.
        joined = [f"ray_kwargs.ray_init.num_gpus={gpus_per_node}"]
    hydra_dir = f"hydra.run.dir={out / 'hydra'}"
    return trainer_command(method, overrides, out / "metrics.jsonl", [*joined, hydra_dir, *extra])


def dry_run(cmd: list[str], ray_address: str | None = None) -> int:
    """Run the trainer command ``cmd`` with ``DRY_RUN=1``, as the launchers' dry run does: the recipe's entry point
    composes the full config with every override and validates it (the recipe's checks, verl's validate_config, the
    batch arithmetic), then stops before Ray. Prints its ``[dry run]`` summary lines (not the resolved YAML), or its
    one-line error; returns its exit status (2: a bad key or value). Without the demo's ``hydra.run.dir`` in ``cmd``
    Hydra's folder is a temporary one, so nothing is written.
    """
    env = {**trainer_env(ray_address), "DRY_RUN": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("[dry run]"):
            print(line)
    if proc.returncode:
        lines = proc.stderr.strip().splitlines()
        if os.environ.get("GTPO_TRACEBACK", "0") != "1":
            # the entry point's one line (gtpo: invalid configuration: ...), else the exception's
            lines = [line for line in lines if line.startswith("gtpo: ")] or lines[-1:]
        print("\n".join(lines), file=sys.stderr)
        print(f"[demo] dry run failed (exit {proc.returncode})", file=sys.stderr)
    return proc.returncode


def run_demo(
    assets: DemoAssets,
    method: str,
    steps: int,
    seed: int,
    out: Path,
    extra: list[str],
    *,
    timeout: float = 1800.0,
    ray_address: str | None = None,
    label: str = "demo",
    plots: bool = True,
    also_plot: list[str] | None = None,
    heatmap_step_: int | None = None,
    experiment: str | None = None,
    nnodes: int = 1,
    gpus_per_node: int = 1,
) -> dict:
    """Train one demo run into ``out`` (``metrics.jsonl``, ``train.log``, plots), with the live progress line.

    Returns the summary (also written to ``out/summary.json``): method, seed, exit code, wall time, the reward
    summary of :func:`summarize` and, with ``plots``, the paths of the curves and the token heatmap.
    """
    cmd = demo_command(assets, method, steps, seed, out, extra, ray_address, experiment, nnodes, gpus_per_node)
    metrics_path, rollout_dir, log_path = out / "metrics.jsonl", out / "rollouts", out / "train.log"
    out.mkdir(parents=True, exist_ok=True)
    metrics_path.unlink(missing_ok=True)
    if rollout_dir.is_dir():
        shutil.rmtree(rollout_dir)
    print(f"[{label}] method={method} steps={steps} seed={seed}; trainer log: {log_path}", flush=True)
    t0 = time.monotonic()
    # A private folder for the local cluster's token, gone with the run (mkdtemp: mode 0700).
    with tempfile.TemporaryDirectory(prefix="gtpo-ray-auth-") as token_dir:
        rc = run_trainer_with_progress(
            cmd, cwd=REPO_ROOT, env=trainer_env(ray_address, token_dir), log_path=log_path,
            metrics_path=metrics_path, total_steps=steps, timeout=timeout, label=label, reward_key=REWARD_KEY,
        )  # fmt: skip
    wall = time.monotonic() - t0
    summary = {"method": method, "seed": seed, "returncode": rc, "wall_s": round(wall, 1)}
    summary.update(summarize(load_rewards(metrics_path)))
    if plots:
        summary.update(
            make_plots(out, method, metrics_path, rollout_dir, assets.tokenizer_dir, also_plot or [], heatmap_step_)
        )
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    sys.exit(main())
