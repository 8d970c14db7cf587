"""The thin layer between the pure algorithms in ``gtpo.algorithms`` and verl 0.9.1.

``register`` is the one module that registers everything into verl; it is imported in every Ray process through
``VERL_USE_EXTERNAL_MODULES=gtpo.verl_plugin.register`` or the ``verl.plugins`` entry point ``gtpo``.
"""
