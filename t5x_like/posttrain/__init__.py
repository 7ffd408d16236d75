"""Post-training: LoRA, frozen models, the preference / reward / GRPO / distillation objectives, rollouts, rewards."""
