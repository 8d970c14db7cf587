"""Preemption without loss: on a scheduler's warning, or before the job's known end, the trainer saves the step in
flight and the run exits with 85 (``stop.EXIT_CODE``), which the Slurm script requeues on and
``trainer.resume_mode=auto`` continues from. verl 0.9.1 saves only at ``trainer.save_freq``, so a time limit, an
eviction or ``ray job stop`` would lose every step since.

``channel`` (stop requests through Ray's key-value store), ``driver`` (the driver's signal relay), ``stop`` (the
deadline and the trainer's stop), ``hooks`` (where in verl's step loop it happens) and ``python -m
gtpo.trainer.preemption request`` (``__main__``: a stop from any node). The full story is in
docs/resume-and-preemption.md.
"""
