"""What several test modules share; no test module imports another test module.

- :mod:`tests.support.configs`: the recipe's Hydra config composed in-process.
- :mod:`tests.support.launch`: launcher scripts in dry runs, fake ``ray`` / ``python`` tools, the 7B launcher on CPU.
- :mod:`tests.support.checkpoints`: checkpoint folders as verl writes them, a trainer as far as its checkpoint
  methods look.
- :mod:`tests.support.v1_trainers`: verl's v1 trainer classes without workers, and their advantage step on an
  in-memory TransferQueue.
- :mod:`tests.support.estimators`: batches, references and comparisons for the advantage estimators.
- :mod:`tests.support.forking`: verl actor configs and worker-style micro-batches for the loss hooks.
- :mod:`tests.support.viz`: a token dump with hand-picked values.
- :mod:`tests.support.e2e`: the session's Ray cluster and recipe runs; :mod:`tests.support.dp` and
  :mod:`tests.support.paths`: one actor update through verl's worker code without Ray;
  :mod:`tests.support.slurm`: a one-node Slurm; :mod:`tests.support.browser`: a headless Chromium.
"""
