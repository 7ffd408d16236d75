"""The family configs and the cost models around them, without a transformers model: the published parameter counts of
qwen3_8b / gemma3_4b / mistral_7b, the published config.json values importing as those gin files (Gemma 3's from
transformers 5.x and the hub's 4.x keys), the tiny configs exporting as their family, FLOPs and score buffers under a
sliding window and under local/global layers, and the config.json / GPTConfig options refused by name. The logits,
exports and generation against transformers are tests/test_families.py's."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from t5x_like.interop import hf_config  # pylint: disable=g-import-not-at-top
from t5x_like.model import decoder  # pylint: disable=g-import-not-at-top
from t5x_like.observe import flops  # pylint: disable=g-import-not-at-top
from t5x_like.planning import memory_model  # pylint: disable=g-import-not-at-top
from tests.hf_reference import COMMON  # pylint: disable=g-import-not-at-top
from tests.test_llama import _model_config  # pylint: disable=g-import-not-at-top


@pytest.mark.parametrize("name, published", [("qwen3_8b", 8_190_735_360), ("mistral_7b", 7_241_732_096),
                                           ("gemma3_4b", 3_880_263_168)])
def test_big_configs_have_the_published_parameter_counts(name, published):
  """Qwen3-8B (8.19B), Mistral-7B-v0.1 (7.24B) and Gemma 3 4B's text decoder (3.88B; 4.3B with its vision tower),
  counted as the planner counts them; Gemma's also counted by transformers (a meta-device model of the published
  config)."""
  cfg = _model_config(name)
  cfg.validate()
  assert decoder.count_params(cfg) == published
  assert hf_config.export_architecture(cfg) == {"qwen3_8b": hf_config.QWEN3, "mistral_7b": hf_config.MISTRAL,
                                                "gemma3_4b": hf_config.GEMMA3}[name]
  if name == "gemma3_4b":
    config_cls, kwargs = PUBLISHED[name]
    with torch.device("meta"):
      model = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs))
    assert sum(p.numel() for p in model.parameters()) == published


# The published config.json values of Qwen/Qwen3-8B, mistralai/Mistral-7B-v0.1 and the text_config of
# google/gemma-3-4b-it (the keys our import reads; Gemma 3's as 4.x and the hub write them).
PUBLISHED = {
    "qwen3_8b": (transformers.Qwen3Config, dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, use_sliding_window=False, max_window_layers=36)),
    "mistral_7b": (transformers.MistralConfig, dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-5,
        sliding_window=4096, tie_word_embeddings=False)),
    "gemma3_4b": (transformers.Gemma3TextConfig, dict(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=1024,
        sliding_window_pattern=6, query_pre_attn_scalar=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, final_logit_softcapping=None,
        attn_logit_softcapping=None, tie_word_embeddings=True)),
}


def _hub_gemma3(kwargs: dict) -> dict:
  """The text_config keys of a Gemma 3 config.json as the hub holds it (transformers 4.x names, no layer_types)."""
  return {**COMMON, **kwargs, "model_type": "gemma3_text"}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_big_configs_are_what_the_published_config_json_imports_as(name):
  """From transformers' own to_dict (5.x names: layer_types, rope_parameters per layer kind) and, for Gemma 3, from
  the hub's 4.x keys (sliding_window_pattern, rope_local_base_freq, rope_scaling)."""
  config_cls, kwargs = PUBLISHED[name]
  ours = _model_config(name)
  fields = lambda c: {k: getattr(c, k) for k in hf_config.MODEL_FIELDS if k != "valid_vocab_size"}
  sources = [config_cls(**kwargs).to_dict()] + ([_hub_gemma3(kwargs)] if name == "gemma3_4b" else [])
  for source in sources:
    _, imported = hf_config.from_hf(source, "config.json")
    assert {**fields(imported), "vocab_size": imported.valid_vocab_size} == fields(ours)


TINY_FAMILIES = {"qwen2_tiny": hf_config.QWEN2, "qwen3_tiny": hf_config.QWEN3, "mistral_tiny": hf_config.MISTRAL,
                 "gemma2_tiny": hf_config.GEMMA2, "gemma3_tiny": hf_config.GEMMA3}


@pytest.mark.parametrize("name", list(TINY_FAMILIES))
def test_tiny_configs_are_their_family(name):
  cfg = _model_config(name)
  cfg.validate()
  assert hf_config.export_architecture(dataclasses.replace(cfg, vocab_size=256)) == TINY_FAMILIES[name]


def test_sliding_window_attention_flops():
  """A window W < T counts W keys per query (halved: the mean of min(i + 1, W)); W ≥ T changes nothing."""
  cfg = _model_config("mistral_7b")
  full = dataclasses.replace(cfg, sliding_window=0)
  attention = lambda c, t, halved: flops.forward_flops_per_token(c, t, halved) - 2.0 * flops.matmul_params(c)
  assert attention(cfg, 4096, False) == attention(full, 4096, False)
  assert attention(cfg, 16384, False) == pytest.approx(attention(full, 16384, False) / 4)
  exact = np.minimum(np.arange(1, 16385), 4096).mean()
  assert attention(cfg, 16384, True) == pytest.approx(4.0 * cfg.num_layers * cfg.d_model * exact, rel=1e-4)


def test_local_and_global_layers_flops_and_scores():
  """Gemma 3 4B at T = 16384: 29 local layers count their 1024-key window, the 5 global ones (layers 5, 11, ..., 29)
  all T keys; the memory model's score buffer is a global layer's (the largest)."""
  cfg = _model_config("gemma3_4b")
  assert [i for i in range(cfg.num_layers) if not cfg.layer_is_local(i)] == [5, 11, 17, 23, 29]
  assert flops.attended_keys(cfg, 16384, False) == pytest.approx((29 * 1024 + 5 * 16384) / 34)
  full = dataclasses.replace(cfg, sliding_window=0, sliding_window_pattern=0, rope_local_theta=0.0)
  assert flops.attended_keys(cfg, 1024, True) == flops.attended_keys(full, 1024, True)  # a window ≥ T skips nothing
  assert memory_model.score_elements(cfg, 16384, 1) == memory_model.score_elements(full, 16384, 1)


BAD_OPTIONS = {
    "sliding_window_pattern": (dict(sliding_window=8, sliding_window_pattern=1), "must be 0 .* or ≥ 2"),
    "pattern_without_window": (dict(sliding_window_pattern=2), "needs a sliding_window > 0"),
    "rope_local_theta": (dict(rope_local_theta=100.0), "needs sliding_window_pattern ≥ 2"),
    "softcap_kernel": (dict(attention_softcap=50.0, attention_impl="cudnn"), "not supported by attention_impl='cudnn'"),
    "rope_scaling": (dict(rope_scaling="yarn"), "rope_scaling='yarn'"),
    "norm": (dict(norm="gemma"), "GPTConfig.norm='gemma'"),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_gemma_options_are_one_named_error(case):
  changes, message = BAD_OPTIONS[case]
  cfg = dataclasses.replace(_model_config("gemma2_tiny"), sliding_window=0, sliding_window_pattern=0)
  cfg.validate()
  with pytest.raises(ValueError, match=message) as error:
    dataclasses.replace(cfg, **changes).validate()
  assert "\n" not in str(error.value) and "GPTConfig." in str(error.value)


def test_memory_model_counts_the_scores_the_window_keeps():
  """Blocked causal attention (8 blocks of 2048 rows at T = 16384) reads from W − 1 = 4095 keys before each block's
  first row: the memory model's per-head score buffer is those products, not the causal triangle's."""
  cfg = _model_config("mistral_7b")
  full = memory_model.score_elements(dataclasses.replace(cfg, sliding_window=0), 16384, 1)
  assert full == sum(2048 * 2048 * (i + 1) for i in range(8))
  # blocks 0 and 1 start within the window of key 0; blocks 2..7 each read 4095 + 2048 keys
  assert memory_model.score_elements(cfg, 16384, 1) == 2048 * (2048 + 4096 + 6 * (4095 + 2048))
  assert memory_model.score_elements(cfg, 4096, 1) == memory_model.score_elements(
      dataclasses.replace(cfg, sliding_window=0), 4096, 1)  # a window as long as the sequence skips nothing


BASE = dict(COMMON, architectures=None, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64)
REFUSED = {
    "qwen3_attention_bias": (dict(model_type="qwen3", attention_bias=True), "attention_bias=True is not supported"),
    "qwen2_mixed_window": (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
                           "max_window_layers=1 mixes sliding-window and full-attention layers"),
    "qwen3_layer_types": (dict(model_type="qwen3", use_sliding_window=True, sliding_window=8,
                               layer_types=["full_attention", "sliding_attention"]), "layer_types mixes"),
    "qwen3_odd_head_dim": (dict(model_type="qwen3", head_dim=7), "head_dim=7 is odd"),
    "mistral_rope": (dict(model_type="mistral", rope_parameters={"rope_type": "yarn", "factor": 4.0}),
                     "rope_type='yarn' is not supported"),
    "gemma2_layer_types": (dict(model_type="gemma2", sliding_window=4, num_hidden_layers=3,
                                layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
                           r"layer_types=.* is not supported \(local layers with every N-th layer global"),
    "gemma3_bidirectional": (dict(model_type="gemma3_text", use_bidirectional_attention=True),
                             "use_bidirectional_attention=True is not supported"),
    "gemma2_activation": (dict(model_type="gemma2", hidden_activation="relu"), "hidden_activation='relu'"),
    "gemma2_query_scalar": (dict(model_type="gemma2", sliding_window=4, query_pre_attn_scalar=24.5),
                            r"query_pre_attn_scalar=24.5 is not supported \(a positive integer\)"),
    "gemma3_local_rope": (dict(model_type="gemma3_text", sliding_window=4, layer_types=["sliding_attention",
                                                                                        "full_attention"],
                               rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                                "full_attention": {"rope_type": "default"}}),
                          r"rope_parameters\['sliding_attention'\] rope_type='linear' is not supported"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_options_are_one_named_error(case):
  changes, message = REFUSED[case]
  with pytest.raises(ValueError, match=message) as error:
    hf_config.from_hf({**BASE, **changes}, "config.json")
  assert "\n" not in str(error.value) and "config.json" in str(error.value)


def test_qwen_window_on_every_layer_imports_and_exports():
  """use_sliding_window with max_window_layers 0 is one window for every layer, and exports as such."""
  _, cfg = hf_config.from_hf({**BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
                              "max_window_layers": 0}, "config.json")
  assert (cfg.sliding_window, cfg.qkv_bias, cfg.use_bias) == (8, True, False)
  written = hf_config.to_hf(cfg)
  assert written["use_sliding_window"] and written["layer_types"] == ["sliding_attention"] * 2
  assert hf_config.from_hf(written, "x")[1] == cfg
  with pytest.raises(ValueError, match="GPTConfig.qk_norm with use_bias=True"):
    hf_config.export_architecture(dataclasses.replace(cfg, qk_norm=True, use_bias=True))
