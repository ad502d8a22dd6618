"""Training: the run's setup and step, the loop, objectives, optimizers, GRPO rollouts, metrics, AOT compilation."""
