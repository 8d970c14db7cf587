"""Launch-time tooling: what the entry point and the operator run before a trainer exists.

``validation`` (the recipe's settings, refused at config time), ``async_checks`` and ``batch_checks`` (what a
trainer mode and the world size require), ``driver_checks`` (the entry point's checks of its environment and of the
checkpoint a resume would load, before Ray starts), ``batch_plan`` and ``memory_estimate`` (the arithmetic a
launch implies), ``dry_run`` (resolve and print a configuration without Ray or a GPU) and ``preflight`` with
``preflight_checks`` and ``preflight_cluster`` (a first cluster run's checks, in seconds). Nothing here runs
inside a trainer's step loop (:mod:`gtpo.trainer`) or is called by verl (:mod:`gtpo.verl_plugin`).
"""
