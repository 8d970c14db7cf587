"""verl's actor config and a worker-style micro-batch for the loss hooks (gtpo/verl_plugin/actor_loss.py and the
sequence-level losses), called as verl's ``ppo_loss`` calls them.
"""

from __future__ import annotations

import torch


def actor_config(mode="token-mean", loss_mode="vanilla"):
    """verl's ``FSDPActorConfig`` with aggregation ``mode``, DAPO's clip range and ``policy_loss.loss_mode``."""
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(
        strategy="fsdp",
        rollout_n=2,
        ppo_micro_batch_size_per_gpu=2,
        ppo_mini_batch_size=2,
        loss_agg_mode=mode,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        calculate_entropy=True,
        policy_loss={"loss_mode": loss_mode},
    )


def micro_batch(prompt_lens, resp_ents, advs, *, dp_size=1, batch_num_tokens=None, extra=None, old_ent=None):
    """A worker-style micro-batch (jagged tensors) and model_output, log-probs at ratio 1; returns
    ``(data, model_output, log_probs_leaf, entropy_leaf)``."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    def nt(xs):
        return torch.nested.as_nested_tensor(xs, layout=torch.jagged)

    resp_lens = [len(e) for e in resp_ents]
    data = TensorDict(
        {
            "prompts": nt([torch.ones(p, dtype=torch.long) for p in prompt_lens]),
            "responses": nt([torch.ones(r, dtype=torch.long) for r in resp_lens]),
            "response_mask": nt([torch.ones(r, dtype=torch.long) for r in resp_lens]),
            "old_log_probs": nt([torch.zeros(r) for r in resp_lens]),
            "advantages": nt([torch.tensor(a, dtype=torch.float32) for a in advs]),
        },
        batch_size=[len(prompt_lens)],
    )
    if old_ent is not None:
        data["entropy"] = nt([torch.tensor(e, dtype=torch.float32) for e in old_ent])
    total = sum(prompt_lens) + sum(resp_lens)
    tu.assign_non_tensor(
        data, dp_size=dp_size, batch_num_tokens=batch_num_tokens or sum(resp_lens), global_batch_size=len(prompt_lens)
    )
    if extra:
        tu.assign_non_tensor(data, **extra)
    # Flat (no-padding) model outputs; response token t of row i sits at seq_start + p_i - 1 + t.
    ent_flat = torch.zeros(total)
    start = 0
    for p, e in zip(prompt_lens, resp_ents, strict=True):
        ent_flat[start + p - 1 : start + p - 1 + len(e)] = torch.tensor(e)
        start += p + len(e)
    ent_leaf = ent_flat.clone().requires_grad_(True)
    logp = torch.zeros(total, requires_grad=True)
    return data, {"log_probs": logp, "entropy": ent_leaf * 1.0}, logp, ent_leaf


def forking_params(**kw):
    """The forking-token selection switched on, with ``kw`` (``rho``, ...)."""
    from gtpo.algorithms.token_selection import ForkingParams

    return ForkingParams(enable=True, **kw)
