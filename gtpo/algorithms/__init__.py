"""Pure tensor math of the recipe's algorithms (torch only: no verl, Ray, vLLM or OmegaConf)."""
