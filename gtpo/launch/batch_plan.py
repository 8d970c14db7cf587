"""The batch plan of a launch configuration: the arithmetic verl checks late, or only inside its workers.

:func:`batch_plan` (step 3 of the dry run, :mod:`gtpo.launch.dry_run`) checks, on a resolved config, that the
train batch splits into whole PPO mini-batches, every mini-batch splits evenly over the data-parallel ranks (world
size / Ulysses SP size), micro-batches divide the per-rank mini-batch, dynamic-batch token budgets hold one full
prompt + response, the vLLM replicas (TP x DP x PP) tile the GPUs, and grouped estimators get at least two
responses per prompt (``verl/workers/engine_workers.py``, ``verl/utils/seqlen_balancing.py``); it returns the
numbers behind each check for the dry run's summary. :func:`rollout_pool` is the standalone rollout pool of
``separate_async`` (the preflight's node count reads it too). Every failure is a ``ValueError`` naming the keys and
values at fault.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from gtpo.methods import METHODS

__all__ = ["GROUP_ESTIMATORS", "batch_plan", "rollout_pool"]

# Estimators that normalise within a prompt's group of responses (with rollout.n == 1 every advantage is zero): the
# method table's grouped rows, and verl's other group estimators.
GROUP_ESTIMATORS = frozenset(
    {row.adv_estimator for row in METHODS.values() if row.grouped}
    | {"grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo"}
)


def _positive_int(cfg: DictConfig, key: str) -> int:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r}: must be a positive integer")
    return value


def _sp_size(node: DictConfig) -> int:
    """Ulysses size of an actor/ref node: the legacy top-level key wins when > 1, as FSDPActorConfig does."""
    legacy = node.get("ulysses_sequence_parallel_size", 1) or 1
    engine = (node.get("fsdp_config") or {}).get("ulysses_sequence_parallel_size", 1) or 1
    return legacy if legacy > 1 else engine


def batch_plan(cfg: DictConfig, use_reference_policy: bool = False) -> dict[str, Any]:
    """Check the batch arithmetic of a resolved config and return the numbers behind it.

    Args:
        cfg: resolved configuration (``actor_rollout_ref``, ``data``, ``trainer`` blocks of verl's ppo_trainer).
        use_reference_policy: whether the reference model runs (its token budget is then checked too).

    Returns:
        dict with ``n_gpus``, ``sp``, ``dp``, ``rollout_replicas``, ``max_seq_len``, ``sequences_per_step``,
        ``mini_batches_per_step``, ``sequences_per_rank_per_mini_batch``.

    Raises:
        ValueError: naming the keys whose values do not divide, do not fit, or are out of range.
    """
    arr = cfg.actor_rollout_ref
    actor, rollout, ref = arr.actor, arr.rollout, arr.ref
    nnodes = _positive_int(cfg, "trainer.nnodes")
    per_node = _positive_int(cfg, "trainer.n_gpus_per_node")
    n_gpus = nnodes * per_node
    train_bsz = _positive_int(cfg, "data.train_batch_size")
    n = _positive_int(cfg, "actor_rollout_ref.rollout.n")
    mini = _positive_int(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size")

    estimator = str(cfg.algorithm.adv_estimator)
    if estimator in GROUP_ESTIMATORS and n < 2:
        raise ValueError(
            f"actor_rollout_ref.rollout.n={n}: algorithm.adv_estimator={estimator} normalises within a group of "
            "responses per prompt and needs n >= 2"
        )

    sp = _sp_size(actor)
    if n_gpus % sp:
        raise ValueError(
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} does not divide the world size "
            f"trainer.nnodes * trainer.n_gpus_per_node = {nnodes} * {per_node} = {n_gpus}"
        )
    dp = n_gpus // sp
    fsdp_size = (actor.get("fsdp_config") or {}).get("fsdp_size", -1)
    if fsdp_size is not None and fsdp_size > 0 and n_gpus % fsdp_size:
        raise ValueError(f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size} does not divide {n_gpus} GPUs")

    if mini > train_bsz or train_bsz % mini:
        raise ValueError(
            f"data.train_batch_size={train_bsz} must be a multiple of actor_rollout_ref.actor.ppo_mini_batch_size="
            f"{mini} (whole PPO mini-batches per step)"
        )
    mini_seqs = mini * n
    if mini_seqs % dp:
        raise ValueError(
            f"ppo_mini_batch_size * rollout.n = {mini} * {n} = {mini_seqs} sequences do not split evenly over "
            f"{dp} data-parallel ranks (world {n_gpus} / ulysses_sequence_parallel_size {sp})"
        )
    per_rank = mini_seqs // dp

    prompt = max(_positive_int(cfg, "data.max_prompt_length"), rollout.get("prompt_length") or 0)
    response = max(_positive_int(cfg, "data.max_response_length"), rollout.get("response_length") or 0)
    max_seq = prompt + response

    dynamic = bool(actor.use_dynamic_bsz)
    if bool(rollout.log_prob_use_dynamic_bsz) != dynamic:
        raise ValueError(
            f"actor_rollout_ref.rollout.log_prob_use_dynamic_bsz={rollout.log_prob_use_dynamic_bsz} must equal "
            f"actor_rollout_ref.actor.use_dynamic_bsz={actor.use_dynamic_bsz} (the actor worker asserts it)"
        )
    if dynamic:
        budgets = [
            ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu, sp),
            ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", rollout.log_prob_max_token_len_per_gpu, sp),
        ]
        if use_reference_policy and ref.get("log_prob_use_dynamic_bsz", dynamic):
            budgets.append(
                (
                    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                    ref.log_prob_max_token_len_per_gpu,
                    _sp_size(ref),
                )
            )
        for key, budget, group in budgets:
            # verl packs micro-batches of up to budget * sp tokens per SP group; one sequence must fit.
            if budget is None or budget * group < max_seq:
                raise ValueError(
                    f"{key}={budget} * ulysses_sequence_parallel_size {group} < max_prompt_length + "
                    f"max_response_length = {prompt} + {response} = {max_seq}: one full sequence must fit"
                )
    else:
        micro = actor.get("ppo_micro_batch_size_per_gpu")
        if micro is None or micro < 1 or per_rank % micro:
            raise ValueError(
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro} must be set and divide the per-rank "
                f"mini-batch of {per_rank} sequences (use_dynamic_bsz=False)"
            )
        checks = [("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", rollout)]
        if use_reference_policy:
            checks.append(("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", ref))
        for key, node in checks:
            value = node.get("log_prob_micro_batch_size_per_gpu")
            if value is None or value < 1:
                raise ValueError(f"{key}={value}: must be a positive integer when use_dynamic_bsz=False")

    tp = _positive_int(cfg, "actor_rollout_ref.rollout.tensor_model_parallel_size")
    rdp = _positive_int(cfg, "actor_rollout_ref.rollout.data_parallel_size")
    rpp = _positive_int(cfg, "actor_rollout_ref.rollout.pipeline_model_parallel_size")
    replica = tp * rdp * rpp
    if n_gpus % replica or (replica > per_node and replica % per_node) or (replica < per_node and per_node % replica):
        raise ValueError(
            f"rollout replica size tensor_model_parallel_size * data_parallel_size * pipeline_model_parallel_size = "
            f"{tp} * {rdp} * {rpp} = {replica} must tile trainer.n_gpus_per_node={per_node} on {nnodes} node(s)"
        )
    util = rollout.gpu_memory_utilization
    if not 0.0 < util <= 1.0:
        raise ValueError(f"actor_rollout_ref.rollout.gpu_memory_utilization={util}: must be in (0, 1]")
    max_model_len = rollout.get("max_model_len")
    if max_model_len is not None and max_model_len < max_seq:
        raise ValueError(f"actor_rollout_ref.rollout.max_model_len={max_model_len} < prompt + response = {max_seq}")
    batched = rollout.get("max_num_batched_tokens")
    if not rollout.get("enable_chunked_prefill", True) and batched is not None and batched < max_seq:
        raise ValueError(
            f"actor_rollout_ref.rollout.max_num_batched_tokens={batched} < prompt + response = {max_seq} while "
            "enable_chunked_prefill=False: vLLM cannot schedule a full-length prompt"
        )

    pool = rollout_pool(cfg)
    if pool is not None and pool[1] > 0:  # a pool of 0 GPUs is refused by check_trainer_mode, naming the key
        pool_nodes, pool_per_node = pool
        if (replica > pool_per_node and replica % pool_per_node) or (
            replica < pool_per_node and pool_per_node % replica
        ):
            raise ValueError(
                f"rollout replica size {replica} (tensor x data x pipeline parallel) must tile the standalone pool's "
                f"actor_rollout_ref.rollout.n_gpus_per_node={pool_per_node} on {pool_nodes} node(s)"
            )

    return {
        "n_gpus": n_gpus,
        "sp": sp,
        "dp": dp,
        "rollout_replicas": n_gpus // replica,
        "max_seq_len": max_seq,
        "sequences_per_step": train_bsz * n,
        "mini_batches_per_step": train_bsz // mini,
        "sequences_per_rank_per_mini_batch": per_rank,
        "dynamic_bsz": dynamic,
    }


def rollout_pool(cfg: DictConfig) -> tuple[int, int] | None:
    """``(nodes, GPUs per node)`` of the standalone rollout pool under separate_async, else None."""
    from gtpo.launch.async_checks import verl_mode

    if verl_mode(str(cfg.trainer.v1.trainer_mode)) != "separate_async":
        return None
    rollout = cfg.actor_rollout_ref.rollout
    return int(rollout.get("nnodes") or 0), int(rollout.get("n_gpus_per_node") or 0)
