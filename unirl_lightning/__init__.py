"""unirl_lightning: async RL post-training (GRPO, PPO, Flow-GRPO) the Lightning way."""
