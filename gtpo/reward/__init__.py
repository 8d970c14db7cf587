"""Rule-based math reward with hard time limits (see ``gtpo.reward.math``).

verl config: ``reward.custom_reward_function.path=pkg://gtpo.reward.math`` and ``.name=compute_score``.
"""

from gtpo.reward.math import (
    EXTRACTIONS,
    GRADE_STATUSES,
    RESULT_KEYS,
    compute_score,
    compute_score_async,
    compute_score_inline,
    compute_scores_batch,
)

__all__ = [
    "EXTRACTIONS",
    "GRADE_STATUSES",
    "RESULT_KEYS",
    "compute_score",
    "compute_score_async",
    "compute_score_inline",
    "compute_scores_batch",
]
