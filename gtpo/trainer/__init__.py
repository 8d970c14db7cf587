"""The trainer's runtime: what runs inside verl's step loop and around it in the driver.

``modes`` registers the recipe's three trainers, each verl v1 trainer with the recipe's behaviour composed from one
class per concern: the advantage hand-off (``advantage``: what a method needs from the batch, the actor loss, with
``group_sizes``), ``resume/`` (checkpoints, the recipe's state, resharding), ``preemption/`` (save and exit on a
scheduler's warning), ``guard/`` (stage deadlines, start-up checks), ``observe/`` (dumps, validation columns, the
trackers across a resume), and the replay buffer's settings (``dynamic_sampling``: DAPO's round limit).
``mode_names`` lists the modes without importing the trainers. The room reads the method table and the knobs
(:mod:`gtpo.methods`, :mod:`gtpo.knobs`) and the actor loss (:mod:`gtpo.verl_plugin.actor_loss`); it never imports
the registration (:mod:`gtpo.verl_plugin.register`, which imports ``modes``) or the launch tooling (:mod:`gtpo.launch`).
"""
