"""Launch-time tooling: what the operator and the entry point run before a trainer exists.

``launcher`` (``scripts/run.sh METHOD MODEL``: a run's name, paths and overrides from the presets, ``runs``) and
``submit`` (here, or as a Ray job); ``checks`` (every check before Ray, once) with ``batch_checks`` (the batch
arithmetic, one rule per function); ``dry_run`` (resolve and print without Ray or a GPU) with ``memory_estimate`` and
``state_memory``; ``preflight`` with ``preflight_checks`` and ``preflight_cluster`` (a first cluster run's checks, in
seconds); ``ray_auth`` and ``job_exit``. Nothing here runs inside a trainer's step loop (:mod:`gtpo.trainer`) or is
called by verl (:mod:`gtpo.verl_plugin`).
"""
