"""The batch arithmetic of a launch, checked before Ray starts: one rule per function, each returning its numbers.

verl 0.9.1 applies these rules inside its workers, minutes after launch; :func:`batch_plan` runs them all on the
composed config (:func:`gtpo.launch.checks.validate_recipe_config`) and returns the numbers the dry run prints. As
verl applies them with its FSDP engines (the recipe's presets; Megatron's parallel sizes are not modelled):

* an engine has ``world / Ulysses size`` data-parallel ranks (verl's ``get_data_parallel_size`` of the FSDP engine);
  a role's Ulysses size is its ``ulysses_sequence_parallel_size`` when > 1, else its ``fsdp_config``'s (verl's
  ``FSDPActorConfig``); the reference model's defaults to the actor's;
* a PPO mini-batch of ``ppo_mini_batch_size x rollout.n`` responses splits evenly over the actor's ranks;
* before the log-prob passes the trainer pads a step's responses to a multiple of
  ``lcm(actor ranks, mini-batch responses)`` (plus the critic's mini-batch when a critic runs; without the actor's
  during ``trainer.critic_warmup``: verl's ``_get_required_batch_multiple``), and each pass splits them over its
  engine's ranks, unevenly when they do not divide (TransferQueue's ``KVBatchMeta.chunk``); a step computes
  ``parameter_sync_step`` slices of ``train_batch_size / parameter_sync_step`` prompts one after another;
* a fixed micro-batch divides every rank's share (verl's ``prepare_micro_batches``); the old-policy pass runs on the
  actor's engine, whose ``use_dynamic_bsz`` verl requires ``rollout.log_prob_use_dynamic_bsz`` to equal; with LoRA
  the reference pass runs there too;
* a dynamic-batch budget of ``budget x Ulysses size`` tokens holds one full prompt + response and verl's 128-token
  padding row (``SYNTHETIC_PADDING_SEQ_LEN``).

Every refusal is a ``ValueError`` naming the keys and numbers at fault. :func:`startup_notes` are the slices' one
surprise that is not a refusal: batch-scope statistics computed per slice.
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gtpo.methods import METHODS, knob

__all__ = ["GROUP_ESTIMATORS", "batch_plan", "rollout_pool", "startup_notes", "ulysses_size", "verl_mode"]

ARR = "actor_rollout_ref"
PASSES = {"rollout": "old-policy", "ref": "reference"}
# verl's own v1 modes, behind the recipe's (gtpo.trainer.modes.TRAINER_MODES maps one to the other).
VERL_MODES = ("sync", "colocate_async", "separate_async")
# Estimators that normalise within a prompt's group of responses: the method table's grouped rows, and verl's other
# group estimators.
GROUP_ESTIMATORS = frozenset(
    {row.adv_estimator for row in METHODS.values() if row.grouped}
    | {"grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo"}
)


def _get(config: DictConfig, key: str, default=None):
    return OmegaConf.select(config, key, default=default)


def _positive(config: DictConfig, key: str) -> int:
    value = _get(config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r}: must be a positive integer")
    return value


def verl_mode(trainer_mode: str) -> str | None:
    """The verl mode behind ``trainer.v1.trainer_mode`` (``gtpo_colocate_async`` -> ``colocate_async``), or None."""
    from gtpo.trainer.mode_names import TRAINER_MODES

    if trainer_mode in TRAINER_MODES:
        return TRAINER_MODES[trainer_mode]
    return trainer_mode if trainer_mode in VERL_MODES else None


def world(config: DictConfig) -> tuple[int, int, int]:
    """``(GPUs, nodes, GPUs per node)`` of the trainer's pool."""
    nnodes, per_node = _positive(config, "trainer.nnodes"), _positive(config, "trainer.n_gpus_per_node")
    return nnodes * per_node, nnodes, per_node


def ulysses_size(config: DictConfig, role: str) -> tuple[str, int]:
    """``(key, size)`` of a role's Ulysses size: the top-level key when > 1, else the engine's."""
    top = f"{ARR}.{role}.ulysses_sequence_parallel_size"
    if int(_get(config, top, 1) or 1) > 1:
        return top, int(_get(config, top))
    engine = f"{ARR}.{role}.fsdp_config.ulysses_sequence_parallel_size"
    return engine, int(_get(config, engine, 1) or 1)


def data_parallel_ranks(config: DictConfig, role: str, shape: tuple[int, int, int]) -> tuple[int, str]:
    """A role's data-parallel ranks and their description: its Ulysses size divides the world ``shape``."""
    n_gpus, nnodes, per_node = shape
    key, sp = ulysses_size(config, role)
    if sp < 1 or n_gpus % sp:
        raise ValueError(
            f"{key}={sp} does not divide the world size trainer.nnodes={nnodes} x trainer.n_gpus_per_node="
            f"{per_node} = {n_gpus}; use a divisor of {n_gpus}"
        )
    fsdp_size = _get(config, f"{ARR}.{role}.fsdp_config.fsdp_size", -1)
    if fsdp_size is not None and fsdp_size > 0 and n_gpus % fsdp_size:
        raise ValueError(f"{ARR}.{role}.fsdp_config.fsdp_size={fsdp_size} does not divide {n_gpus} GPUs")
    return n_gpus // sp, f"{n_gpus // sp} data-parallel ranks (world {n_gpus} / Ulysses {sp})"


def engines(config: DictConfig) -> dict[str, str]:
    """Log-prob pass -> the role whose engine runs it: the reference pass runs on the actor's engine with LoRA."""
    from verl.trainer.ppo.utils import need_reference_policy

    roles = {"rollout": "actor"}
    if need_reference_policy(config):
        lora = int(_get(config, f"{ARR}.model.lora.rank", 0) or 0) or int(
            _get(config, f"{ARR}.model.lora_rank", 0) or 0
        )
        in_actor = lora > 0 or _get(config, f"{ARR}.model.lora_adapter_path") is not None
        roles["ref"] = "actor" if in_actor else "ref"
    return roles


def group_size(config: DictConfig) -> int:
    """``rollout.n``: a grouped estimator needs two responses per prompt (with one every advantage is zero)."""
    n, estimator = _positive(config, f"{ARR}.rollout.n"), str(config.algorithm.adv_estimator)
    if estimator in GROUP_ESTIMATORS and n < 2:
        raise ValueError(
            f"{ARR}.rollout.n={n}: algorithm.adv_estimator={estimator} normalises within a group of responses per "
            "prompt and needs n >= 2"
        )
    return n


def mini_batches(config: DictConfig) -> int:
    """PPO mini-batches per step (a last short one is padded with no-op rows): the train batch holds one at least."""
    train, mini = _positive(config, "data.train_batch_size"), _positive(config, f"{ARR}.actor.ppo_mini_batch_size")
    if mini > train:
        raise ValueError(
            f"{ARR}.actor.ppo_mini_batch_size={mini} > data.train_batch_size={train}: a PPO mini-batch takes at most "
            "the step's prompts"
        )
    return -(-train // mini)


def mini_batch_share(config: DictConfig, n: int, actor: tuple[int, str], shape: tuple[int, int, int]) -> int:
    """Responses each actor rank gets of a mini-batch: the mini-batch splits evenly over the ranks (``actor``)."""
    (dp, ranks), (_, nnodes, per_node) = actor, shape
    mini = _positive(config, f"{ARR}.actor.ppo_mini_batch_size")
    if mini * n % dp:
        raise ValueError(
            f"{ARR}.actor.ppo_mini_batch_size={mini} x rollout.n={n} = {mini * n} responses per mini-batch do not "
            f"split evenly over trainer.nnodes={nnodes} x trainer.n_gpus_per_node={per_node}: {ranks}; the "
            f"mini-batch must be a multiple of {dp} responses"
        )
    return mini * n // dp


def dynamic_batches(config: DictConfig) -> bool:
    """The actor engine's ``use_dynamic_bsz``, which the old-policy pass shares: verl asserts both flags equal."""
    actor = bool(_get(config, f"{ARR}.actor.use_dynamic_bsz", False))
    rollout = bool(_get(config, f"{ARR}.rollout.log_prob_use_dynamic_bsz", actor))
    if rollout != actor:
        raise ValueError(
            f"{ARR}.rollout.log_prob_use_dynamic_bsz={rollout} must equal {ARR}.actor.use_dynamic_bsz={actor}: the "
            "old-policy pass runs on the actor's engine and verl's actor worker asserts it"
        )
    return actor


def sequence_length(config: DictConfig) -> tuple[int, str]:
    """Tokens of one full prompt + response (the agent loop's caps, else the data's), and the keys they come from."""
    parts = []
    for data_key, rollout_key in (("max_prompt_length", "prompt_length"), ("max_response_length", "response_length")):
        value, key = _get(config, f"{ARR}.rollout.{rollout_key}"), f"{ARR}.rollout.{rollout_key}"
        if value is None or value == _get(config, f"data.{data_key}"):
            key = f"data.{data_key}"
            value = _positive(config, key)
        parts.append((key, int(value)))
    total = sum(v for _, v in parts)
    return total, " + ".join(f"{k}={v}" for k, v in parts) + f" = {total}"


def token_budgets(config: DictConfig, tokens: int, lengths: str, dynamic: bool, roles: dict[str, str]) -> None:
    """Each dynamic-batch budget holds one full sequence and verl's 128-token padding row."""
    from verl.trainer.ppo.padding_utils import SYNTHETIC_PADDING_SEQ_LEN

    budgets = []  # (key, the role whose engine runs the pass)
    if dynamic:
        budgets = [(f"{ARR}.actor.ppo_max_token_len_per_gpu", "actor")]
        budgets.append((f"{ARR}.rollout.log_prob_max_token_len_per_gpu", "actor"))
    if roles.get("ref") == "ref" and _get(config, f"{ARR}.ref.log_prob_use_dynamic_bsz", False):
        budgets.append((f"{ARR}.ref.log_prob_max_token_len_per_gpu", "ref"))
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
                f"the ranks (a failed rollout session, dynamic sampling): set it to at least "
                f"{-(-SYNTHETIC_PADDING_SEQ_LEN // sp)}"
            )


def training_micro_batch(config: DictConfig, share: int, dynamic: bool, ranks: str) -> None:
    """A fixed training micro-batch divides the responses each rank gets of a mini-batch."""
    micro = _get(config, f"{ARR}.actor.ppo_micro_batch_size_per_gpu")
    if not dynamic and micro and share % int(micro):
        raise ValueError(
            f"{ARR}.actor.ppo_micro_batch_size_per_gpu={micro} does not divide the {share} responses each rank gets "
            f"of a mini-batch over {ranks}; use a divisor of {share} or {ARR}.actor.use_dynamic_bsz=true"
        )


def _shares(rows: int, ranks: int) -> set[int]:
    """Rows per rank when ``rows`` are chunked over ``ranks`` (the first ``rows % ranks`` get one more)."""
    return {rows // ranks} | ({rows // ranks + 1} if rows % ranks else set())


def step_slices(config: DictConfig) -> int:
    """Slices of the train batch a step computes one after another: ``parameter_sync_step`` divides the batch, and
    under separate_async a slice is one mini-batch (verl syncs the weights after each)."""
    mode = verl_mode(str(_get(config, "trainer.v1.trainer_mode", "sync")))
    if mode is None:
        return 1
    batch, key = _positive(config, "data.train_batch_size"), f"trainer.v1.{mode}.parameter_sync_step"
    sync = _get(config, key, 1)
    if isinstance(sync, bool) or not isinstance(sync, int) or sync < 1:
        raise ValueError(f"{key}={sync!r}: must be a positive integer")
    if batch % sync:
        raise ValueError(f"data.train_batch_size={batch} is not divisible by {key}={sync}")
    mini = _positive(config, f"{ARR}.actor.ppo_mini_batch_size")
    if mode == "separate_async" and batch != sync * mini:
        raise ValueError(
            f"data.train_batch_size={batch} != {key}={sync} x {ARR}.actor.ppo_mini_batch_size={mini}: separate_async "
            f"syncs weights after parameter_sync_step mini-batches of one step (e.g. {key}={max(1, batch // mini)})"
        )
    return sync


def log_prob_micro_batches(
    config: DictConfig, n: int, dynamic: bool, slices: int, roles: dict[str, str], ranks: dict[str, tuple[int, str]]
) -> None:
    """A fixed log-prob micro-batch divides every share of the padded rows its pass splits over its engine's ranks
    (``roles``: :func:`engines`; ``ranks``: each engine's :func:`data_parallel_ranks`)."""
    rows = int(config.data.train_batch_size) // slices * n
    mini_rows = int(config.actor_rollout_ref.actor.ppo_mini_batch_size) * n
    terms = [ranks["actor"][0]]
    critic = _get(config, "critic.enable")  # verl's need_critic
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
        role_dp, role_desc = ranks[engine]
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


def _tiles(replica: int, per_node: int) -> bool:
    return not ((replica > per_node and replica % per_node) or (replica < per_node and per_node % replica))


def rollout_replicas(
    config: DictConfig, tokens: int, pool: tuple[int, int] | None, shape: tuple[int, int, int]
) -> tuple[int, int]:
    """``(vLLM replicas on the trainer's GPUs, GPUs per replica)``: replicas tile the nodes (and the standalone
    ``pool``'s), and vLLM's context and scheduler step hold one full sequence."""
    n_gpus, nnodes, per_node = shape
    rollout = f"{ARR}.rollout"
    tp, rdp, rpp = (
        _positive(config, f"{rollout}.{k}_parallel_size") for k in ("tensor_model", "data", "pipeline_model")
    )
    replica = tp * rdp * rpp
    if n_gpus % replica or not _tiles(replica, per_node):
        raise ValueError(
            f"rollout replica size tensor_model_parallel_size * data_parallel_size * pipeline_model_parallel_size = "
            f"{tp} * {rdp} * {rpp} = {replica} must tile trainer.n_gpus_per_node={per_node} on {nnodes} node(s)"
        )
    util = _get(config, f"{rollout}.gpu_memory_utilization")
    if not 0.0 < util <= 1.0:
        raise ValueError(f"{rollout}.gpu_memory_utilization={util}: must be in (0, 1]")
    max_model_len = _get(config, f"{rollout}.max_model_len")
    if max_model_len is not None and max_model_len < tokens:
        raise ValueError(f"{rollout}.max_model_len={max_model_len} < prompt + response = {tokens}")
    batched = _get(config, f"{rollout}.max_num_batched_tokens")
    if not _get(config, f"{rollout}.enable_chunked_prefill", True) and batched is not None and batched < tokens:
        raise ValueError(
            f"{rollout}.max_num_batched_tokens={batched} < prompt + response = {tokens} while "
            "enable_chunked_prefill=False: vLLM cannot schedule a full-length prompt"
        )
    if pool is not None and not _tiles(replica, pool[1]):
        raise ValueError(
            f"rollout replica size {replica} (tensor x data x pipeline parallel) must tile the standalone pool's "
            f"{rollout}.n_gpus_per_node={pool[1]} on {pool[0]} node(s)"
        )
    return n_gpus // replica, replica


def rollout_pool(config: DictConfig) -> tuple[int, int] | None:
    """``(nodes, GPUs per node)`` of the standalone rollout pool under separate_async (both set), else None."""
    if verl_mode(str(config.trainer.v1.trainer_mode)) != "separate_async":
        return None
    for key in (f"{ARR}.rollout.nnodes", f"{ARR}.rollout.n_gpus_per_node"):
        value = _get(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{key}={value!r}: separate_async needs a standalone rollout pool of its own GPUs (a positive count, "
                f"on nodes of its own, or beside the trainer's on shared nodes where both fit), e.g. {key}=1"
            )
    return int(_get(config, f"{ARR}.rollout.nnodes")), int(_get(config, f"{ARR}.rollout.n_gpus_per_node"))


def batch_plan(config: DictConfig) -> dict[str, Any]:
    """Every rule above, in order; the numbers behind them for the dry run's summary.

    Raises:
        ValueError: the first rule broken, naming the keys and values at fault.
    """
    n = group_size(config)
    steps = mini_batches(config)
    slices = step_slices(config)
    pool = rollout_pool(config)
    shape, roles = world(config), engines(config)
    ranks = {engine: data_parallel_ranks(config, engine, shape) for engine in ("actor", *roles.values())}
    share = mini_batch_share(config, n, ranks["actor"], shape)
    dynamic = dynamic_batches(config)
    tokens, lengths = sequence_length(config)
    token_budgets(config, tokens, lengths, dynamic, roles)
    training_micro_batch(config, share, dynamic, ranks["actor"][1])
    log_prob_micro_batches(config, n, dynamic, slices, roles, ranks)
    replicas, _ = rollout_replicas(config, tokens, pool, shape)
    return {
        "n_gpus": shape[0],
        "sp": ulysses_size(config, "actor")[1],
        "dp": ranks["actor"][0],
        "rollout_replicas": replicas,
        "max_seq_len": tokens,
        "sequences_per_step": int(config.data.train_batch_size) * n,
        "mini_batches_per_step": steps,
        "sequences_per_rank_per_mini_batch": share,
        "dynamic_bsz": dynamic,
        "rollout_pool": pool,
    }


def startup_notes(config: DictConfig) -> list[str]:
    """A configuration that runs but differs from what its keys suggest: batch-scope statistics under
    ``parameter_sync_step > 1``, where verl's step computes the advantages of each slice on its own."""
    mode = verl_mode(str(config.trainer.v1.trainer_mode))
    sync_step = (_get(config, f"trainer.v1.{mode}.parameter_sync_step", 1) or 1) if mode else 1
    if sync_step <= 1:
        return []
    estimator = str(config.algorithm.adv_estimator)
    scopes = []
    if estimator == "gtpo":
        scopes += [f"algorithm.gtpo.{k}=batch" for k in ("norm_scope", "weight_scope")
                   if _get(config, f"algorithm.gtpo.{k}") == "batch"]  # fmt: skip
    forking = knob(config.algorithm, "forking")
    if forking.enable and forking.scope == "batch":
        scopes.append("algorithm.forking.scope=batch")
    if not scopes:
        return []
    prompts, n = int(config.data.train_batch_size), int(config.actor_rollout_ref.rollout.n)
    per_slice = prompts // sync_step
    logged = f"{estimator}/estimator_rows" if estimator == "gtpo" else "forking/batch_scope_rows"
    return [
        f"{', '.join(scopes)} with trainer.v1.{mode}.parameter_sync_step={sync_step}: verl's step computes the "
        f"advantages of each of its {sync_step} slices on its own, so these statistics cover one slice of "
        f"{per_slice} prompts ({per_slice * n} responses), not the step's {prompts} ({prompts * n}) as under "
        f"trainer=sync (logged per call as {logged}). The whole-batch scope needs parameter_sync_step=1, i.e. one "
        "update of the whole batch per step under separate_async; group scopes (norm_scope=group, weight_scope="
        "group, forking scope=micro_batch) do not depend on it."
    ]
