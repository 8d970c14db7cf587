"""verl entry point of the gtpo recipe: ``python -m recipe.gtpo.main_gtpo <hydra overrides>``."""
