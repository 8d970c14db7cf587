"""Tools for verl's multi-turn agent loop (``ToolAgentLoop``) that run no model-written code: the calculator
(:mod:`gtpo.tools.calculator`), the hermes tool-call parser that answers a call it cannot parse with an error
(:mod:`gtpo.tools.hermes`), and the checks of a run's tool config before Ray starts (:mod:`gtpo.tools.config`)."""
