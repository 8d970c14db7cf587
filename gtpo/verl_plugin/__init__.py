"""The adapters verl calls, between the pure algorithms in ``gtpo.algorithms`` and verl 0.9.1.

The estimators (``entropy_shaping``: GTPO, GRPO-S and GROP; ``trajectory``: GTPO-trajectory), the forking-token loss
(``forking``), the losses' min / max metrics (``loss_metrics``) and the list of modules verl imports (``config``);
none of them imports the trainer's runtime (:mod:`gtpo.trainer`) or the launch tooling. ``register`` is the one
module above both rooms: it registers everything into verl, the trainer modes of :mod:`gtpo.trainer` included, and
hands those the actor loss; it is imported in every Ray process through
``VERL_USE_EXTERNAL_MODULES=gtpo.verl_plugin.register`` or the ``verl.plugins`` entry point ``gtpo``.
"""
