"""The reference Hugging Face models the interop tests build (small random configs, no hub download): one per
family we convert, saved with a byte-level BPE tokenizer, and each imported with `from_hf`; plus the logits
of either side on a right-padded batch."""

import dataclasses

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from t5x_like.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
from t5x_like.interop import hf  # pylint: disable=g-import-not-at-top
from t5x_like.model import decoder  # pylint: disable=g-import-not-at-top
from t5x_like.training import checkpointing  # pylint: disable=g-import-not-at-top

VOCAB = 300  # not a multiple of 128: the import pads to 384
TEXT = "the quick brown fox jumps over the lazy dog; hello world, hello there. " * 4
COMMON = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# Weights larger than HF's default 0.02 so attention is peaked: a wrong position or head mapping shows.
INIT = 0.25
MODELS = {
    "gpt2": (transformers.GPT2Config, dict(n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    # grouped-query (4 query heads, 2 kv heads), untied head, biases on every projection, rope theta != default
    "llama_gqa": (transformers.LlamaConfig, dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=64, rope_theta=500.0,
                                                 tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    # multi-head (fused qkv), tied, Llama-3 frequency scaling with all three wavelength regimes at head_dim 8
    "llama3_scaled": (transformers.LlamaConfig, dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=64, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    # 4 SwiGLU experts per layer, top-2, grouped-query; a sliding window spanning every position (= full causal)
    "mixtral": (transformers.MixtralConfig, dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=64, sliding_window=64, num_local_experts=4,
                                                 num_experts_per_tok=2, router_aux_loss_coef=0.02)),
}


def save_tokenizer(folder):
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator([TEXT], tokenizers.trainers.BpeTrainer(
      vocab_size=VOCAB, special_tokens=["<|endoftext|>", *tokenizer_lib.CHAT_TOKENS],  # markers: SFT below
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
  fast.save_pretrained(folder)
  return fast


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  return save_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory, tokenizer):
  """name → (HF model in float32 eval mode, its saved folder with tokenizer files)."""
  out = {}
  for i, (name, (config_cls, kwargs)) in enumerate(MODELS.items()):
    torch.manual_seed(i)
    config = config_cls(**COMMON, initializer_range=INIT, **kwargs)
    config._attn_implementation = "eager"  # pylint: disable=protected-access
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    folder = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out[name] = (model, folder)
  return out


@pytest.fixture(scope="module")
def imported(hf_models, tmp_path_factory):
  """name → (MODEL_DIR, float32 GPTConfig, params) of each model converted with from_hf."""
  out = {}
  for name, (_, folder) in hf_models.items():
    model_dir = str(tmp_path_factory.mktemp("imported") / name)
    config = hf.import_hf(folder, model_dir)
    _, params = checkpointing.restore_params(model_dir)
    out[name] = (model_dir, dataclasses.replace(config, dtype="float32"), params)
  return out


def padded_batch():
  """(tokens, segment_ids) of three right-padded rows: 12, 7 and 4 real tokens."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB, (3, 12)).astype(np.int32)
  segment_ids = (np.arange(12)[None] < np.array([[12], [7], [4]])).astype(np.int32)
  return tokens * segment_ids, segment_ids


def hf_logits(model, tokens, segment_ids):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(segment_ids, dtype=torch.long)).logits.numpy()


def our_logits(config, params, tokens, segment_ids):
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  return np.asarray(jax.jit(decoder.GPT(config).apply)({"params": params}, tokens, positions, segment_ids))
