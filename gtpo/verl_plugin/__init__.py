"""The recipe seen from verl: every row of :data:`gtpo.methods.METHODS` in verl's registries, and the actor loss.

``estimators`` (one adapter from verl's calling conventions to a row's estimator and policy loss), ``actor_loss``
(the forking-token loss and the min / max metrics of a registered loss, installed in the actor workers by the
recipe's trainers), ``config`` (the list of modules verl imports) and ``register``, imported in every Ray process
through ``VERL_USE_EXTERNAL_MODULES=gtpo.verl_plugin.register`` or the ``verl.plugins`` entry point ``gtpo``. The
trainer's runtime (:mod:`gtpo.trainer`) imports ``actor_loss``; only ``register`` imports the trainer.
"""
