"""Evaluation: unbiased pass@k / avg@n / maj@k (``gtpo.eval.metrics``), sampling presets (``gtpo.eval.presets``)
and the offline CLI ``python -m gtpo.eval`` (``gtpo.eval.cli``)."""
