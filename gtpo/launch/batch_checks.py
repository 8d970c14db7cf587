"""Batch arithmetic at the run's world size, checked before Ray starts.

Run by :func:`gtpo.launch.validation.validate_recipe_config` (the entry point, real and ``DRY_RUN=1`` launches,
before Ray starts); verl 0.9.1 checks these only inside the workers, minutes after launch. The rules, as verl applies
them with its FSDP engines (the recipe's presets; Megatron's parallel sizes are not modelled here), restated from the
verl definitions the row ``batch-arithmetic`` of the Seams table in ``docs/architecture.md`` names and
``tests/test_seams.py`` pins:

* Data-parallel ranks: an FSDP engine has ``world / Ulysses size`` of them (``FSDPEngine.get_data_parallel_size``,
  ``verl/workers/engine/fsdp/transformer_impl.py``), the world being ``nnodes × n_gpus_per_node``. The Ulysses size
  of a role is its ``ulysses_sequence_parallel_size`` when > 1, else its ``fsdp_config.ulysses_sequence_parallel_size``
  (``FSDPActorConfig.__post_init__``, ``verl/workers/config/actor.py``); the reference model's defaults to the
  actor's. A size that does not divide the world is refused.
* A PPO mini-batch of ``ppo_mini_batch_size × rollout.n`` responses is split evenly over the actor's
  data-parallel ranks (``TrainingWorker.train_mini_batch``, ``verl/workers/engine_workers.py``).
* Before the log-prob passes the trainer pads a step's responses with no-op rows to a multiple of
  ``lcm(actor dp ranks, mini-batch responses)`` (the critic's mini-batch joins the lcm when a critic runs; the
  actor's leaves it during ``trainer.critic_warmup`` steps: ``PPOTrainer._get_required_batch_multiple`` /
  ``_balance_batch``, ``verl/trainer/ppo/v1/trainer_base.py``). The old-policy pass splits them over the actor's
  ranks, the reference pass (run when a KL term needs it) over the reference model's (``KVBatchMeta.chunk``,
  ``transfer_queue/metadata.py``: uneven shares when its rank count does not divide). A step computes
  ``trainer.v1.<mode>.parameter_sync_step`` such slices of ``train_batch_size / parameter_sync_step`` prompts one
  after another (``PPOTrainer.__init__`` reads the step count, ``PPOTrainer.step`` runs the slices).
* Without dynamic batch sizes a fixed micro-batch must divide every rank's share (``prepare_micro_batches``,
  ``verl/workers/engine/utils.py``). The old-policy pass runs on the actor's engine with the actor's
  ``use_dynamic_bsz``, which verl requires to equal ``rollout.log_prob_use_dynamic_bsz``
  (``ActorRolloutRefWorker.init_model``, ``verl/workers/engine_workers.py``); with LoRA the reference pass runs
  there too (``ref_in_actor``: ``PPOTrainer._setup`` sets it, ``PPOTrainer._compute_ref_log_prob`` reads it).
* With dynamic batch sizes every sequence must fit one micro-batch: ``budget × Ulysses size`` tokens
  (``prepare_micro_batches``; ``rearrange_micro_batches``, ``verl/utils/seqlen_balancing.py``) must hold one full
  prompt + response (the agent loop caps them at ``rollout.prompt_length`` / ``response_length``:
  ``AgentLoopBase._cap_text_prompt_length``, ``verl/experimental/agent_loop/agent_loop.py``, and
  ``SingleTurnAgentLoop.run``; by default ``data.max_prompt_length`` / ``max_response_length``), and verl's 128-token
  synthetic padding row (``SYNTHETIC_PADDING_SEQ_LEN``, ``verl/trainer/ppo/padding_utils.py``), which the padding
  above adds (``upsample_batch_to_divisible_size``).

Every refusal is a ``ValueError`` naming the keys and numbers at fault.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

__all__ = ["check_micro_batches", "check_token_budgets", "ulysses_size"]

ARR = "actor_rollout_ref"
PASSES = {"rollout": "old-policy", "ref": "reference"}


def _get(config: DictConfig, key: str, default=None):
    return OmegaConf.select(config, key, default=default)


def ulysses_size(config: DictConfig, role: str) -> tuple[str, int]:
    """``(key, size)`` of a role's Ulysses size: the top-level key when > 1, else the engine's."""
    top = f"{ARR}.{role}.ulysses_sequence_parallel_size"
    if int(_get(config, top, 1) or 1) > 1:
        return top, int(_get(config, top))
    engine = f"{ARR}.{role}.fsdp_config.ulysses_sequence_parallel_size"
    return engine, int(_get(config, engine, 1) or 1)


def _world(config: DictConfig) -> tuple[int, str]:
    nnodes, gpus = int(_get(config, "trainer.nnodes", 1)), int(_get(config, "trainer.n_gpus_per_node", 1))
    if nnodes < 1 or gpus < 1:
        raise ValueError(f"trainer.nnodes={nnodes} x trainer.n_gpus_per_node={gpus}: both must be >= 1")
    return nnodes * gpus, f"trainer.nnodes={nnodes} x trainer.n_gpus_per_node={gpus}"


def _ranks(config: DictConfig, role: str) -> tuple[int, str]:
    """A role's data-parallel ranks and their description; a Ulysses size that does not divide is refused."""
    world, keys = _world(config)
    key, sp = ulysses_size(config, role)
    if sp < 1 or world % sp:
        raise ValueError(f"{key}={sp} does not divide the world size {keys} = {world}; use a divisor of {world}")
    return world // sp, f"{world // sp} data-parallel ranks (world {world} / Ulysses {sp})"


def _roles(config: DictConfig) -> dict[str, str]:
    """Log-prob role -> the role whose engine runs it: the reference pass runs on the actor's engine with LoRA."""
    from verl.trainer.ppo.utils import need_reference_policy

    roles = {"rollout": "actor"}
    if need_reference_policy(config):
        lora = int(_get(config, f"{ARR}.model.lora.rank", 0) or 0)
        lora = lora if lora > 0 else int(_get(config, f"{ARR}.model.lora_rank", 0) or 0)
        in_actor = lora > 0 or _get(config, f"{ARR}.model.lora_adapter_path") is not None
        roles["ref"] = "actor" if in_actor else "ref"
    return roles


def _dynamic(config: DictConfig) -> bool:
    """The actor engine's ``use_dynamic_bsz``; verl asserts the rollout's log-prob flag equals it."""
    actor = bool(_get(config, f"{ARR}.actor.use_dynamic_bsz", False))
    rollout = bool(_get(config, f"{ARR}.rollout.log_prob_use_dynamic_bsz", actor))
    if rollout != actor:
        raise ValueError(
            f"{ARR}.rollout.log_prob_use_dynamic_bsz={rollout} must equal {ARR}.actor.use_dynamic_bsz={actor}: the "
            "old-policy pass runs on the actor's engine and verl's actor worker asserts it"
        )
    return actor


def _sequence(config: DictConfig) -> tuple[int, str] | None:
    """Tokens of one full prompt + response, and the keys they come from."""
    parts = []
    for data_key, rollout_key in (("max_prompt_length", "prompt_length"), ("max_response_length", "response_length")):
        value, key = _get(config, f"{ARR}.rollout.{rollout_key}"), f"{ARR}.rollout.{rollout_key}"
        if value is None or value == _get(config, f"data.{data_key}"):
            value, key = _get(config, f"data.{data_key}"), f"data.{data_key}"
        if value is None:
            return None
        parts.append((key, int(value)))
    total = sum(v for _, v in parts)
    return total, " + ".join(f"{k}={v}" for k, v in parts) + f" = {total}"


def check_token_budgets(config: DictConfig) -> None:
    """Raise ``ValueError`` when a dynamic-batch token budget cannot hold one full prompt + response."""
    sequence = _sequence(config)
    if sequence is None:
        return
    tokens, lengths = sequence
    budgets = []  # (key, the role whose engine runs the pass)
    if _dynamic(config):
        budgets = [(f"{ARR}.actor.ppo_max_token_len_per_gpu", "actor")]
        budgets.append((f"{ARR}.rollout.log_prob_max_token_len_per_gpu", "actor"))
    if _roles(config).get("ref") == "ref" and _get(config, f"{ARR}.ref.log_prob_use_dynamic_bsz", False):
        budgets.append((f"{ARR}.ref.log_prob_max_token_len_per_gpu", "ref"))
    from verl.trainer.ppo.padding_utils import SYNTHETIC_PADDING_SEQ_LEN

    for key, role in budgets:
        budget, (_, sp) = _get(config, key), ulysses_size(config, role)
        if budget is None or int(budget) * sp < tokens:
            held = "no" if budget is None else f"{budget} x Ulysses {sp} = {int(budget) * sp}"
            raise ValueError(
                f"{key}={budget}: a micro-batch holds {held} tokens, less than one full sequence of {lengths} "
                f"tokens (verl stops in its workers: 'max_token_len must be greater than the sequence length'); set "
                f"it to at least {-(-tokens // sp)}"
            )
        if int(budget) * sp < SYNTHETIC_PADDING_SEQ_LEN:
            raise ValueError(
                f"{key}={budget}: a micro-batch holds {budget} x Ulysses {sp} = {int(budget) * sp} tokens, less than "
                f"the {SYNTHETIC_PADDING_SEQ_LEN}-token padding row verl adds when a batch is short of a multiple of "
                f"the ranks (a failed rollout session, dynamic sampling; verl/trainer/ppo/padding_utils.py): set it "
                f"to at least {-(-SYNTHETIC_PADDING_SEQ_LEN // sp)}"
            )


def _shares(rows: int, ranks: int) -> set[int]:
    """Rows per rank when ``rows`` are chunked over ``ranks`` (the first ``rows % ranks`` get one more)."""
    return {rows // ranks} | ({rows // ranks + 1} if rows % ranks else set())


def check_micro_batches(config: DictConfig) -> None:
    """Raise ``ValueError`` when the Ulysses sizes, the fixed micro-batches or the token budgets do not fit the
    world size (see the module's docstring for verl's rules)."""
    from gtpo.launch.async_checks import verl_mode

    roles = _roles(config)
    role_ranks = {engine: _ranks(config, engine) for engine in roles.values()}  # "actor" always among them
    dp, ranks = role_ranks["actor"]
    check_token_budgets(config)
    _, keys = _world(config)
    n = int(_get(config, f"{ARR}.rollout.n", 1))
    mini = _get(config, f"{ARR}.actor.ppo_mini_batch_size")
    train_batch = _get(config, "data.train_batch_size")
    if mini is None or train_batch is None:
        return
    mini_rows = int(mini) * n
    if mini_rows % dp:
        raise ValueError(
            f"{ARR}.actor.ppo_mini_batch_size={mini} x rollout.n={n} = {mini_rows} responses per mini-batch do not "
            f"split evenly over {keys}: {ranks}; the mini-batch must be a multiple of {dp} responses"
        )
    dynamic = _dynamic(config)
    micro = _get(config, f"{ARR}.actor.ppo_micro_batch_size_per_gpu")
    if not dynamic and micro and (mini_rows // dp) % int(micro):
        raise ValueError(
            f"{ARR}.actor.ppo_micro_batch_size_per_gpu={micro} does not divide the {mini_rows // dp} responses each "
            f"rank gets of a mini-batch: {mini_rows} over {ranks}; use a divisor of {mini_rows // dp} or "
            f"{ARR}.actor.use_dynamic_bsz=true"
        )
    mode = verl_mode(str(_get(config, "trainer.v1.trainer_mode", "sync")))
    slices = int(_get(config, f"trainer.v1.{mode}.parameter_sync_step", 1) or 1) if mode else 1
    rows = int(train_batch) // slices * n
    terms = [dp]
    critic = _get(config, "critic.enable")  # verl's need_critic (verl/trainer/ppo/utils.py)
    if critic if critic is not None else _get(config, "algorithm.adv_estimator") == "gae":
        terms.append(int(_get(config, "critic.ppo_mini_batch_size")) * n)
    multiples = [(math.lcm(*terms, mini_rows), f"lcm({', '.join(map(str, terms))}, mini-batch {mini_rows})")]
    if _get(config, "trainer.critic_warmup"):  # no actor update yet: verl leaves the mini-batch out of the lcm
        multiples.append((math.lcm(*terms), f"lcm({', '.join(map(str, terms))}) during trainer.critic_warmup"))
    for role, engine in roles.items():
        prefix = f"{ARR}.{'rollout' if engine == 'actor' else 'ref'}"
        role_dynamic = _get(config, f"{ARR}.ref.log_prob_use_dynamic_bsz", False) if engine == "ref" else dynamic
        micro = _get(config, f"{prefix}.log_prob_micro_batch_size_per_gpu")
        if role_dynamic or not micro:
            continue
        role_dp, role_desc = role_ranks[engine]
        for multiple, how in multiples:
            shares = _shares(-(-rows // multiple) * multiple, role_dp)
            bad = [share for share in sorted(shares) if share % int(micro)]
            if bad:
                who = "each rank gets" if len(shares) == 1 else "some ranks get"
                raise ValueError(
                    f"{prefix}.log_prob_micro_batch_size_per_gpu={micro} does not divide the {bad[0]} responses {who} "
                    f"of the {PASSES[role]} log-prob pass: {rows} responses, padded to a multiple of {how} = "
                    f"{multiple}, over {role_desc}; use a divisor of {math.gcd(*shares)} or "
                    f"{prefix}.log_prob_use_dynamic_bsz=true"
                )
