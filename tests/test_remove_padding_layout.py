"""Worker-side losses under ``use_remove_padding=true``: the model-output layout verl's FSDP engine builds on GPU.

    .venv/bin/pytest -q tests/test_remove_padding_layout.py

CPU runs use ``use_remove_padding=false``; every GPU preset uses ``true``. The two branches of
``FSDPEngineWithLMHead.prepare_model_outputs`` (verl/workers/engine/fsdp/transformer_impl.py) hand the loss
differently built tensors:

- remove padding: the model runs on one packed row ``(1, total_nnz + pad)`` (all sequences' valid tokens
  concatenated, plus the Ulysses / bucket alignment pad at the tail); ``_gather_and_unpad_packed`` drops the tail and
  ``nested_tensor_from_jagged(values, input_ids.offsets())`` wraps the ``(total_nnz,)`` values;
- padded (CPU): the model runs on ``input_ids.to_padded_tensor()`` ``(bsz, max_seq)``, valid tokens first in each
  row; ``torch.nested.narrow`` + ``cat`` cut the padding columns out and the same ``nested_tensor_from_jagged`` wraps
  the result.

Both layouts are built here exactly that way from one set of per-token values, with a huge entropy and a distinct
log-prob on every position that is not a real token (alignment pad, padding columns), then fed to the forking loss
and to verl's ``ppo_loss`` with the ``grpo_s`` policy loss. Asserted: identical selected tokens (via the gradient's
support), loss, denominator and gradient per real token; no gradient on any pad position.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.forking import actor_config

PAD_H = 1e4  # entropy on non-token positions: selecting one would dominate the threshold and the loss
PAD_LOGP = -7.0  # log-prob on non-token positions: counting one would move the loss

PROMPT_LENS = [3, 1, 2]
RESP_ENTROPY = [[0.2, 0.9, 0.1, 0.7], [0.5, 0.95], [0.3, 0.8, 0.6]]
RESP_ADV = [[1.0, 2.0, 3.0, 4.0], [-1.0, -2.0], [0.5, 1.5, 2.5]]
RESP_LOGP = [[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6], [-0.7, -0.8, -0.9]]
ALIGN_PAD = 3  # tokens appended to the packed row for Ulysses SP / static bucket alignment


def _nested(rows, dtype=torch.float32):
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def _data(old_logp_shift=0.0):
    """A v1 worker micro-batch (TransferQueue fields are jagged nested tensors)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    resp_lens = [len(r) for r in RESP_ENTROPY]
    seq_lens = [p + r for p, r in zip(PROMPT_LENS, resp_lens, strict=True)]
    data = TensorDict(
        {
            "input_ids": _nested([[1] * s for s in seq_lens], torch.long),
            "prompts": _nested([[1] * p for p in PROMPT_LENS], torch.long),
            "responses": _nested([[1] * r for r in resp_lens], torch.long),
            "response_mask": _nested([[1] * r for r in resp_lens], torch.long),
            "old_log_probs": _nested([[x + old_logp_shift for x in r] for r in RESP_LOGP]),
            "advantages": _nested(RESP_ADV),
        },
        batch_size=[len(PROMPT_LENS)],
    )
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=sum(resp_lens), global_batch_size=len(PROMPT_LENS))
    return data


def _per_sequence(resp_values, pad_value):
    """Per-sequence values over prompt + response, model-output convention: position p_i - 1 + t predicts token t."""
    rows = []
    for p, vals in zip(PROMPT_LENS, resp_values, strict=True):
        row = [pad_value] * (p - 1) + list(vals) + [pad_value]  # last position predicts past the response
        rows.append(row)
    return rows


def _packed_outputs(data):
    """remove-padding branch: packed row with tail alignment pad -> drop the pad -> jagged on input_ids offsets."""
    cu_seqlens = data["input_ids"].offsets()
    leaves = {}
    out = {}
    for key, vals, pad in (("entropy", RESP_ENTROPY, PAD_H), ("log_probs", RESP_LOGP, PAD_LOGP)):
        flat = [x for row in _per_sequence(vals, pad) for x in row] + [pad] * ALIGN_PAD
        leaf = torch.tensor(flat, requires_grad=True)
        leaves[key] = leaf
        values = (leaf * 1.0)[:-ALIGN_PAD]  # _gather_and_unpad_packed(tensor, pad_size)
        out[key] = torch.nested.nested_tensor_from_jagged(values, cu_seqlens)
    return out, leaves


def _padded_outputs(data):
    """padded branch: (bsz, max_seq) output, valid tokens first -> narrow + cat -> jagged on input_ids offsets."""
    cu_seqlens = data["input_ids"].offsets()
    seq_lens = cu_seqlens.diff()
    width = int(seq_lens.max()) + 2  # extra padding columns, as in a real padded batch
    leaves = {}
    out = {}
    for key, vals, pad in (("entropy", RESP_ENTROPY, PAD_H), ("log_probs", RESP_LOGP, PAD_LOGP)):
        rows = [row + [pad] * (width - len(row)) for row in _per_sequence(vals, pad)]
        leaf = torch.tensor(rows, requires_grad=True)
        leaves[key] = leaf
        narrowed = torch.nested.narrow(leaf * 1.0, 1, torch.zeros_like(seq_lens), seq_lens, layout=torch.jagged)
        values = torch.cat(list(narrowed.unbind()))
        out[key] = torch.nested.nested_tensor_from_jagged(values, cu_seqlens)
    return out, leaves


def _padded_leaf_to_packed(grad: torch.Tensor) -> torch.Tensor:
    """Gather the real-token positions of a ``(bsz, width)`` gradient into the packed order."""
    lens = [p + len(r) for p, r in zip(PROMPT_LENS, RESP_ENTROPY, strict=True)]
    return torch.cat([grad[i, :n] for i, n in enumerate(lens)])


def _run(loss_fn, build, data):
    out, leaves = build(data)
    loss, metrics = loss_fn(out, data)
    loss.backward()
    return loss, metrics, leaves


def _check_same(packed, padded):
    (loss_a, metrics_a, leaves_a), (loss_b, metrics_b, leaves_b) = packed, padded
    torch.testing.assert_close(loss_a, loss_b)
    for key in ("log_probs",):
        grad_a = leaves_a[key].grad
        grad_b = leaves_b[key].grad
        # No gradient on the alignment pad nor on any padding column.
        assert torch.all(grad_a[-ALIGN_PAD:] == 0)
        packed_b = _padded_leaf_to_packed(grad_b)
        assert grad_b.abs().sum() == pytest.approx(packed_b.abs().sum())
        torch.testing.assert_close(grad_a[:-ALIGN_PAD], packed_b)
    return metrics_a, metrics_b, leaves_a["log_probs"].grad[:-ALIGN_PAD]


def _response_positions():
    """Packed indices of response token (i, t), in row-major order."""
    out, start = [], 0
    for p, r in zip(PROMPT_LENS, RESP_ENTROPY, strict=True):
        out.append([start + p - 1 + t for t in range(len(r))])
        start += p + len(r)
    return out


def test_forking_loss_is_layout_independent_under_remove_padding():
    from gtpo.algorithms.token_selection import ForkingParams
    from gtpo.verl_plugin.actor_loss import ForkingPPOLoss

    fn = ForkingPPOLoss(actor_config("token-mean"), ForkingParams(enable=True, rho=0.3))
    data = _data()
    metrics_a, metrics_b, grad = _check_same(_run(fn, _packed_outputs, data), _run(fn, _padded_outputs, _data()))
    # 9 response tokens, rho 0.3 -> k = ceil(2.7) = 3: entropies 0.95 (A=-2), 0.9 (A=2), 0.8 (A=1.5).
    pos = _response_positions()
    expected = torch.zeros_like(grad)
    for (i, t), adv in (((1, 1), -2.0), ((0, 1), 2.0), ((2, 1), 1.5)):
        expected[pos[i][t]] = -adv / 3  # vanilla clipped loss at ratio 1 is -A, token-mean over 3 selected
    torch.testing.assert_close(grad, expected)
    for metrics in (metrics_a, metrics_b):
        assert metrics["forking/selected_token_frac"].values == [pytest.approx(3 / 9)]
        assert metrics["forking/entropy_threshold"].values == [pytest.approx(0.8)]


def test_grpo_s_loss_is_layout_independent_under_remove_padding():
    from verl.workers.utils.losses import ppo_loss

    import gtpo.verl_plugin.register  # noqa: F401  (registers the grpo_s policy loss)

    config = actor_config("seq-mean-token-mean", loss_mode="grpo_s")

    def fn(out, data):
        return ppo_loss(config, out, data)

    # Old log-probs shifted so sequence ratios differ from 1 (inside the clip range).
    _, _, grad = _check_same(_run(fn, _packed_outputs, _data(0.05)), _run(fn, _padded_outputs, _data(0.05)))
    # Every response token, and only those, carries gradient; prompt and pad positions none.
    pos = {j for row in _response_positions() for j in row}
    support = set(torch.nonzero(grad).flatten().tolist())
    assert support == pos
