"""LoRA through verl's real trainer and vLLM's LoRA on the CPU backend: trains, syncs the adapter, resumes.

    GTPO_SLOW_TESTS=1 .venv/bin/python -m pytest -q -p no:cacheprovider -m e2e tests/test_e2e_lora.py

The slow tier (tests/conftest.py). ``actor_rollout_ref.model.lora_rank=8 lora_alpha=16 target_modules=all-linear``:
verl's FSDP engine trains a PEFT adapter on the frozen tiny Qwen2; every weight sync sends the base weights once and
then the adapter's tensors to vLLM, which loads them as a LoRA adapter (``TensorLoRARequest``, vLLM's ``punica_cpu``
kernels on this backend) and samples every request with it. Before ``gtpo.cpu.vllm_patches`` patch 4 the first sync
failed inside vLLM's engine core (``'WeightsMapper' object has no attribute 'get_unstacked_mapper'``).

GTPO, two steps with a checkpoint at step 2, then a resumed run to step 3. Checked:

* each sync delivered the adapter: vLLM's worker logged ``vLLM load weights, loaded_params: 28`` (7 linear modules
  x 2 layers x A and B) at every step, and each run loaded the base weights once;
* the weights vLLM samples with are the trained ones after every sync: at every step, verl's
  ``rollout_corr/log_ppl_diff_max`` / ``_min`` (per response, mean rollout log-prob minus the actor's
  ``old_log_prob``) are within :data:`SYNC_TOL` of :func:`oov_offset`, while the step-2 adapter moves the same
  quantity by more than :data:`MIN_EFFECT` (computed here with PEFT from the checkpoint, on random sequences: a
  sync that left vLLM on the base weights or on an older adapter would show a gap of that size, e.g. at step 3 of
  the resumed run, which samples with exactly that adapter). Measured over three runs: within 3e-5 of the offset,
  effect 0.021-0.033; with vLLM made to keep the first adapter it received (a planted fault), step 2 was 0.023 off;
* the checkpoints hold the adapters only (``save_lora_only``, as the LoRA preset sets it), and they trained: every
  ``lora_B`` is non-zero at step 2 (PEFT starts B at 0), the adapter changed again by step 3;
* the resume restored the adapter and the optimizer: the resumed run keeps steps 1-2 of the log and continues at 3,
  and its step-3 checkpoint holds AdamW state whose step count is the first run's plus one.

The same agreement under ``trainer=colocate_async`` (the other mode that keeps LoRA: its weight sync is the same naive
in-process path; ``separate_async``'s engines send no adapter and are refused before Ray,
:func:`gtpo.launch.checks.check_lora_weight_sync`), with ``num_warmup_batches=0`` so that every step's responses come
from the weights of the sync before it (the default generates a batch ahead: its responses lag a policy behind by
design, which the agreement would measure instead of the sync).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.support.e2e import assert_ran, base_overrides, run_recipe, tail

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LORA = [
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=16",
    "actor_rollout_ref.model.target_modules=all-linear",
    # as configs/adapter/lora.yaml: checkpoints of the adapters only
    "+actor_rollout_ref.actor.checkpoint.save_lora_only=true",
]
ADAPTER_TENSORS = 7 * 2 * 2  # q, k, v, o, gate, up, down in each of the 2 layers; A and B
LR = 1e-2
SYNC_TOL = 3e-4  # |mean log-prob difference - oov_offset| per response, vLLM vs the actor, both fp32
MIN_EFFECT = 5e-3  # what the step-2 adapter moves a mean log-prob by, at least (measured 0.021-0.033)


def load_shards(step_dir) -> tuple[dict[str, torch.Tensor], dict]:
    """The full model state dict and the optimizer state of a world-size-1 checkpoint's ``actor/`` folder."""
    actor = step_dir / "actor"
    model = torch.load(actor / "model_world_size_1_rank_0.pt", weights_only=False)
    optim = torch.load(actor / "optim_world_size_1_rank_0.pt", weights_only=False)
    local = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in model.items()}
    return local, optim


def lora_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if ".lora_A." in k or ".lora_B." in k}


def oov_offset(assets) -> float:
    """What vLLM's log-probs exceed the actor's by with identical weights: verl masks the model's vocabulary rows
    past the tokenizer's to -inf in vLLM (``monkey_patch_compute_logits``), the actor normalises over all of them
    (151,936 rows, 151,665 tokens). The tiny model's distributions are near uniform, so about ln(151936 / 151665)
    per token, with or without LoRA."""
    import math

    from transformers import AutoConfig, AutoTokenizer

    vocab = AutoConfig.from_pretrained(assets.model_dir).vocab_size
    return math.log(vocab / len(AutoTokenizer.from_pretrained(assets.tokenizer_dir)))


def adapter_effect(model_dir, state: dict[str, torch.Tensor]) -> float:
    """max over 8 random 40-token sequences of |mean log-prob of the last 16 tokens, adapted - base|."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")).eval()
    adapter = {k.replace(".default.", "."): v for k, v in lora_tensors(state).items()}
    result = set_peft_model_state_dict(peft_model, adapter)
    assert not result.unexpected_keys, result.unexpected_keys
    ids = torch.randint(0, base.config.vocab_size, (8, 40), generator=torch.Generator().manual_seed(0))

    def mean_log_prob():
        with torch.no_grad():
            logp = torch.log_softmax(peft_model(input_ids=ids).logits[:, :-1].double(), -1)
        return logp.gather(-1, ids[:, 1:, None])[..., 0][:, -16:].mean(-1)

    adapted = mean_log_prob()
    with peft_model.disable_adapter():
        plain = mean_log_prob()
    return float((adapted - plain).abs().max())


def test_lora_trains_syncs_every_step_and_resumes(ray_cluster, tiny_assets, tmp_path):
    ckpt = tmp_path / "ckpt"
    common = base_overrides(tiny_assets) + [
        *LORA,
        "method=gtpo",
        "algorithm.filter_groups.enable=false",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        f"trainer.default_local_dir={ckpt}",
        "trainer.save_freq=2",
        "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_LOGGING_LEVEL=INFO",
    ]
    first = run_recipe(ray_cluster, tmp_path, common + ["trainer.total_training_steps=2"], name="first")
    assert_ran(first, steps=2)
    resumed = run_recipe(
        ray_cluster,
        tmp_path,
        common + ["trainer.total_training_steps=3", "trainer.resume_mode=auto"],
        name="resumed",
        metrics_name="first",
    )
    assert_ran(resumed, steps=1)
    assert resumed.steps() == [1, 2, 3], resumed.steps()
    assert resumed.metrics[:2] == first.metrics

    # Every sync sent the adapter, and vLLM's worker loaded all of its tensors as a LoRA.
    for run, syncs in ((first, 2), (resumed, 1)):
        loads = [int(n) for n in re.findall(r"vLLM load weights, loaded_params: (\d+)", run.log)]
        assert len(loads) >= syncs and set(loads) == {ADAPTER_TENSORS}, (loads, tail(run.log))
        assert run.log.count("Loading standard weights") == 1, "the base weights go to vLLM once per run"

    # The checkpoints hold the adapters only (save_lora_only, as configs/adapter/lora.yaml sets it): the frozen base is
    # the model folder's, which the resumed run loaded again. The adapter trained, and went on training after the
    # resume.
    s2, o2 = load_shards(ckpt / "global_step_2")
    s3, o3 = load_shards(ckpt / "global_step_3")
    a2, a3 = lora_tensors(s2), lora_tensors(s3)
    assert len(a2) == ADAPTER_TENSORS and a2.keys() == a3.keys()
    assert s2.keys() == a2.keys() and s3.keys() == a3.keys(), sorted(set(s2) - set(a2))[:5]
    assert json.loads((ckpt / "global_step_2" / "actor" / "lora_train_meta.json").read_text())["r"] == 8
    assert all(float(v.abs().max()) > 0 for k, v in a2.items() if ".lora_B." in k), "an adapter B is still zero"
    assert max(float((a3[k] - a2[k]).abs().max()) for k in a2) > 1e-4, "the resumed run did not train the adapter"

    # The optimizer resumed: AdamW's step count went on from the first run's.
    steps2 = {int(st["step"]) for st in o2["state"].values()}
    steps3 = {int(st["step"]) for st in o3["state"].values()}
    assert len(steps2) == 1 and steps3 == {next(iter(steps2)) + 1}, (steps2, steps3)

    # vLLM sampled with the trained adapter after every sync.
    assert_vllm_sampled_the_trained_adapter(tiny_assets, s2, resumed.metrics)


def assert_vllm_sampled_the_trained_adapter(assets, adapter_state, metrics) -> None:
    """At every step the rollout's and the actor's log-probs agree (up to :func:`oov_offset`), while the adapter of
    ``adapter_state`` moves them by more than :data:`MIN_EFFECT`."""
    effect = adapter_effect(assets.model_dir, adapter_state)
    print(f"the adapter moves a mean log-prob by up to {effect:.3e}")
    assert effect > MIN_EFFECT, f"the adapter barely moves the model ({effect:.2e}): the check below would be vacuous"
    offset = oov_offset(assets)
    for entry in metrics:
        data = entry["data"]
        gap = max(abs(data[f"rollout_corr/log_ppl_diff_{end}"] - offset) for end in ("max", "min"))
        print(f"step {entry['step']}: vLLM vs actor, max |mean log-prob diff - {offset:.6f}| {gap:.3e}")
        assert gap < SYNC_TOL, (entry["step"], {k: v for k, v in data.items() if k.startswith("rollout_corr/")})
        assert data["training/rollout_actor_probs_pearson_corr"] > 0.99, data


def test_lora_under_colocate_async_syncs_every_step(ray_cluster, tiny_assets, tmp_path):
    ckpt = tmp_path / "ckpt"
    overrides = base_overrides(tiny_assets) + [
        *LORA,
        "trainer=colocate_async",
        "trainer.v1.colocate_async.num_warmup_batches=0",
        "method=gtpo",
        "algorithm.filter_groups.enable=false",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        f"trainer.default_local_dir={ckpt}",
        "trainer.save_freq=3",
        "trainer.total_training_steps=3",
        "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_LOGGING_LEVEL=INFO",
    ]
    run = run_recipe(ray_cluster, tmp_path, overrides, name="colocate_async")
    assert_ran(run, steps=3)
    loads = [int(n) for n in re.findall(r"vLLM load weights, loaded_params: (\d+)", run.log)]
    assert len(loads) >= 3 and set(loads) == {ADAPTER_TENSORS}, (loads, tail(run.log))
    # every step's responses came from the weights of the sync before it: the agreement below measures the sync
    assert [m["data"]["gtpo/trajectory_staleness_max"] for m in run.metrics] == [0, 0, 0], run.metrics
    state, _ = load_shards(ckpt / "global_step_3")
    assert_vllm_sampled_the_trained_adapter(tiny_assets, state, run.metrics)
