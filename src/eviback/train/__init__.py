"""Training: the warm start (supervised fine-tuning on protocol trajectories) and GRPO with teacher backoff."""
