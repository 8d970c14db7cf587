"""Data preparation: math problems -> verl RL parquet (``python -m gtpo.data.prepare``; see ``gtpo.data.prepare``)."""
