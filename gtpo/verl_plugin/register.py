"""Register the recipe into verl: every row of the method table, the trainer modes and the tool-call parser.

verl imports this module in every process that imports verl, through either hook:

* ``VERL_USE_EXTERNAL_MODULES=gtpo.verl_plugin.register`` (the recipe's entry point also puts it into the Ray
  runtime env, so it reaches the TaskRunner and the actor workers on every node);
* the ``verl.plugins`` entry point ``gtpo`` declared in ``pyproject.toml`` (verl loads it on ``import verl``
  unless ``VERL_USE_EXTERNAL_PLUGINS=none``; its load errors are logged by verl only at DEBUG, so this module
  raises loudly on the first hook instead).

What gets registered: each row of :data:`gtpo.methods.METHODS` with a recipe estimator under its ``adv_estimator``
(``gtpo``, ``grpo_s``, ``gtpo_traj``) and each row's policy loss under its name (``grpo_s``), through the one adapter
of :mod:`gtpo.verl_plugin.estimators`; the trainer modes ``gtpo_sync``, ``gtpo_colocate_async`` and
``gtpo_separate_async`` (``trainer.v1.trainer_mode``) are registered by :mod:`gtpo.trainer.modes` on import, and the
tool-call parser ``gtpo_hermes`` (``multi_turn.format``) by :mod:`gtpo.tools.hermes`. A row added later
(:func:`register_method`: a test's toy method) is registered the same way. verl's checkpoint loads are wrapped to check
the files first (:mod:`gtpo.verl_plugin.checkpoint_loads`); a vLLM server started in the process gets a key nobody
knows when the run asks for it (:mod:`gtpo.verl_plugin.vllm_http`).

Importing twice is harmless: verl's ``register_adv_est`` and ``register_policy_loss`` reject only a *different*
function under a taken name, and each row's function is built once.
"""

from __future__ import annotations

from verl.trainer.ppo.core_algos import (
    ADV_ESTIMATOR_REGISTRY,
    POLICY_LOSS_REGISTRY,
    register_adv_est,
    register_policy_loss,
)

from gtpo import methods
from gtpo.tools import hermes  # noqa: F401 - importing it registers the gtpo_hermes tool-call parser into verl
from gtpo.trainer import mode_names, modes  # noqa: F401 - importing modes registers the trainer modes into verl
from gtpo.verl_plugin import checkpoint_loads, vllm_http
from gtpo.verl_plugin.estimators import VerlEstimator, verl_policy_loss

__all__ = ["ESTIMATORS", "TRAINER_MODES", "register_method"]

TRAINER_MODES = tuple(mode_names.TRAINER_MODES)


def register_method(method: methods.Method) -> methods.Method:
    """Add ``method`` to the table (:func:`gtpo.methods.add`) and register its estimator and policy loss into verl."""
    methods.add(method)
    if method.advantages is not None and method.adv_estimator not in ADV_ESTIMATOR_REGISTRY:
        register_adv_est(method.adv_estimator)(VerlEstimator(method))
    if method.policy_loss is not None and method.name not in POLICY_LOSS_REGISTRY:
        register_policy_loss(method.name)(verl_policy_loss(method))
    return method


for _row in tuple(methods.METHODS.values()):
    register_method(_row)

# verl's workers check the checkpoint files they load, in their own process
checkpoint_loads.install()
# a vLLM server started in this process answers its OpenAI API to nobody (the run asked for it)
vllm_http.lock_api()

ESTIMATORS = tuple(sorted(row.adv_estimator for row in methods.METHODS.values() if row.advantages is not None))
