"""Config checks, and building a run's tokenizer, environment and policy from its config."""
