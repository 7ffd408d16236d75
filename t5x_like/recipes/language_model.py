"""Pre-training and supervised fine-tuning: next-token cross-entropy (per-token `weights`, 0 on prompt tokens).

Full, selective (TrainConfig.trainable) or LoRA (lora.LoraConfig.rank > 0) updates all use this recipe: what
trains is the trainable mask's business, not the method's. Its config, `language_model.LanguageModelConfig`, is
every run's default and so lives beside TrainConfig (training/config.py). Gin: configs/runs/pretrain.gin,
finetune.gin.
"""

from t5x_like.training import config

CONFIG = config.LanguageModelConfig
