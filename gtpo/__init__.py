"""gtpo: entropy-guided credit assignment (GTPO, GRPO-S, GTPO-trajectory) as a verl 0.9.1 recipe.

Importing this package imports nothing from verl, Ray or vLLM; the verl integration lives in
``gtpo.verl_plugin`` and is loaded through ``VERL_USE_EXTERNAL_MODULES=gtpo.verl_plugin.register``
or the ``verl.plugins`` entry point.
"""

__version__ = "0.1.0"
