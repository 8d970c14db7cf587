"""The trainer's runtime: what runs inside verl's step loop and around it in the driver.

``modes`` combines the recipe's behaviour (``mixin``) with verl 0.9.1's three v1 trainers; the rest is what a long
run needs from that loop: ``checkpoints`` / ``checkpoint_state`` / ``checkpoint_world_size`` (resume),
``metric_history`` (the trackers across a resume), ``preemption`` / ``preemption_hooks`` (save and exit on a
scheduler's warning), ``watchdog`` (a stalled stage fails the run), ``dynamic_sampling`` and ``group_sizes`` (the
batch the estimators see) and ``startup_checks`` (what must hold in the workers before step 1). It imports neither
the adapters verl calls (:mod:`gtpo.verl_plugin`; :mod:`gtpo.verl_plugin.register` hands the trainer modes their
actor loss) nor the checks and tools of a launch, which never run in a trainer (:mod:`gtpo.launch`); the knob blocks
it reads come from :mod:`gtpo.knobs`.
"""
