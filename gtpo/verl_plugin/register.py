"""Register the recipe's estimators, policy losses and trainer mode into verl's registries.

verl imports this module in every process that imports verl, through either hook:

* ``VERL_USE_EXTERNAL_MODULES=gtpo.verl_plugin.register`` (the recipe's entry point also puts it into the Ray
  runtime env, so it reaches the TaskRunner and the actor workers on every node);
* the ``verl.plugins`` entry point ``gtpo`` declared in ``pyproject.toml`` (verl loads it on ``import verl``
  unless ``VERL_USE_EXTERNAL_PLUGINS=none``; its load errors are logged by verl only at DEBUG, so this module
  raises loudly on the first hook instead).

What gets registered:

* advantage estimators ``gtpo``, ``grpo_s`` (arXiv 2508.04349) and ``gtpo_traj`` (arXiv 2508.03772);
* policy losses ``grpo_s`` (sequence-level clipped ratio) and the forking-token loss;
* trainer modes ``gtpo_sync``, ``gtpo_colocate_async`` and ``gtpo_separate_async`` (``trainer.v1.trainer_mode``):
  verl's three v1 trainers with the recipe's behaviour (:mod:`gtpo.trainer.modes`), which hands entropy and
  token ids to the estimators, and the actor loss those trainers install in the workers
  (:func:`gtpo.verl_plugin.forking.install`).

This is the one module above both rooms: the adapters (the rest of ``gtpo.verl_plugin``) and the trainer's runtime
(``gtpo.trainer``) import neither each other nor it.

Importing twice is harmless: Python caches the modules, and verl's ``register_adv_est`` only rejects a *different*
function under a taken name.
"""

from __future__ import annotations

from gtpo.trainer import modes
from gtpo.verl_plugin import entropy_shaping, forking, trajectory  # noqa: F401  (importing registers)

# The trainer modes install the recipe's actor loss (forking tokens, or grpo_s's with min / max metrics) after
# init_workers; the runtime imports no adapter, so the loss is handed to it here.
modes.GTPOTrainerMixin.install_actor_loss = forking.install

ESTIMATORS = tuple(sorted(modes.RECIPE_ESTIMATORS))
TRAINER_MODE = modes.TRAINER_MODE
TRAINER_MODES = tuple(modes.TRAINER_MODES)
