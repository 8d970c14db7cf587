"""Run guards: a run that cannot make progress fails within a bounded time, naming why, instead of idling its GPUs.

``watchdog`` (a weight sync or a generation that stops moving fails the run, ``algorithm.watchdog``) and
``startup_checks`` (reward workers that failed in their constructors stop the run before step 1).
"""
