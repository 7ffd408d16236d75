"""Logical axis names: the only vocabulary the model uses to describe its arrays.

`partitioning.py` maps these names onto mesh axes; no other module names a mesh axis.
"""

# Parameter axes.
EMBED = "embed"  # model width of a weight (d_model)
MLP = "mlp"  # hidden units of the feed-forward block (d_ff)
HEADS = "heads"  # attention heads
KV_HEADS = "kv_heads"  # key/value heads of grouped-query attention
KV = "kv"  # per-head width (head_dim)
VOCAB = "vocab"  # vocabulary entries
LAYERS = "layers"  # stacked decoder blocks
NORM = "norm"  # LayerNorm scale/bias vectors
POSITION = "position"  # rows of the learned position table
EXPERT = "expert"  # experts of a mixture-of-experts layer (weights stacked over experts)

# Activation axes.
BATCH = "batch"  # sequences
LENGTH = "length"  # positions inside a sequence
KV_LENGTH = "kv_length"  # key/value positions attention reads: the whole sequence, even when `length` is split
ACT_EMBED = "activation_embed"  # d_model of an activation (kept whole: the batch owns data/fsdp)
ACT_HEADS = "activation_heads"  # heads of an activation
ACT_KV_HEADS = "activation_kv_heads"  # key/value heads of an activation (and of the KV cache)
ACT_MLP = "activation_mlp"  # hidden units of an activation
ACT_VOCAB = "activation_vocab"  # logits' vocabulary axis
STAGE = "stage"  # pipeline stage of a stacked activation or parameter
ACT_EXPERT = "activation_expert"  # expert axis of tokens dispatched to experts (E, groups, capacity, ...)
EXPERT_GROUPS = "expert_groups"  # routing groups of dispatched tokens: the batch less the axes that split experts
