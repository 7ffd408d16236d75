"""FLOPs/token against hand arithmetic and published totals; MFU; the hardware catalogue and CPU peak."""

import json

import jax
import pytest

from t5x_like.observe import flops
from t5x_like.observe import hardware
from t5x_like.model import decoder as model

GPT2 = model.GPTConfig(vocab_size=50257, max_len=1024, num_layers=12, num_heads=12, d_model=768, d_ff=3072)
GPT3 = model.GPTConfig(vocab_size=50304, max_len=2048, num_layers=96, num_heads=96, d_model=12288, d_ff=49152)


def test_gpt2_124m_flops_per_token_by_hand():
  # Parameters: per block qkv 768·2304+2304, out 768·768+768, mlp 768·3072+3072 and 3072·768+768,
  # two LayerNorms 4·768: 12·768² + 13·768 = 7,087,872; ×12 = 85,054,464. Token table 50257·768 =
  # 38,597,376, position table 1024·768 = 786,432, final LayerNorm 1,536 → 124,439,808 (GPT-2 "124M").
  assert model.count_params(GPT2) == 124_439_808
  # N excludes the position table (a gather): 124,439,808 − 786,432 = 123,653,376; 6N = 741,920,256.
  assert flops.matmul_params(GPT2) == 123_653_376
  # Attention: 12·L·T·d = 12·12·1024·768 = 113,246,208 → 855,166,464 FLOPs per token.
  assert flops.train_flops_per_token(GPT2, 1024) == 741_920_256 + 113_246_208 == 855_166_464
  # Causal-halved attention term: 6·12·1024·768 = 56,623,104.
  assert flops.train_flops_per_token(GPT2, 1024, causal_halved=True) == 741_920_256 + 56_623_104
  # Forward only: 2N + 4·L·T·d = 247,306,752 + 37,748,736.
  assert flops.forward_flops_per_token(GPT2, 1024) == 285_055_488


def test_untied_embeddings_count_the_output_projection_once():
  untied = model.GPTConfig(vocab_size=1000, max_len=64, num_layers=2, num_heads=2, d_model=64, d_ff=256,
                           tie_embeddings=False)
  tied = model.GPTConfig(**{**untied.__dict__, "tie_embeddings": True})
  # The untied model adds an lm_head (64·1000 kernel + 1000 bias); its input table is a gather.
  assert flops.matmul_params(untied) == flops.matmul_params(tied) + 1000


def test_gpt3_175b_total_training_flops_match_published_3_14e23():
  tokens = 300e9
  six_n = 6 * flops.matmul_params(GPT3) * tokens  # Brown et al.'s 6·N·D (attention ignored)
  assert abs(six_n / 3.14e23 - 1) < 0.005
  halved = flops.train_flops_per_token(GPT3, 2048, causal_halved=True) * tokens
  assert abs(halved / 3.14e23 - 1) < 0.02  # +1.5%
  full = flops.train_flops_per_token(GPT3, 2048) * tokens  # PaLM's unhalved attention term: +2.8%
  assert 1.02 < full / 3.14e23 < 1.035


def test_remat_adds_recomputed_forward_flops():
  base = flops.train_flops_per_token(GPT3, 2048)
  full = flops.hardware_flops_per_token(GPT3, 2048, "full")
  assert flops.hardware_flops_per_token(GPT3, 2048, "none") == base
  # Full recompute of the blocks: ≈ 8N/6N of the block FLOPs (Megatron's accounting); logits not recomputed.
  assert 1.3 < full / base < 1.34
  assert base < flops.hardware_flops_per_token(GPT3, 2048, "save_dots") < full


def test_mfu_arithmetic():
  # 1M tokens/s × 855M FLOPs/token on 8 devices of 989.4 TFLOP/s: 8.55e14 / 7.915e15 = 10.8%.
  assert flops.mfu(1e6, 855_166_464, 8, 989.4e12) == pytest.approx(855_166_464e6 / (8 * 989.4e12))
  with pytest.raises(ValueError):
    flops.mfu(1.0, 1.0, 0, 1.0)


def test_catalogue_has_the_common_accelerators_and_matches_device_kinds():
  for name in ("a100-40gb", "a100-80gb", "h100", "h200", "tpu_v4", "tpu_v5e", "tpu_v5p", "tpu_v6e", "cpu"):
    assert name in hardware.CATALOGUE
  kinds = {"NVIDIA A100-SXM4-40GB": "a100-40gb", "NVIDIA A100-SXM4-80GB": "a100-80gb",
           "NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "TPU v4": "tpu_v4",
           "TPU v5 lite": "tpu_v5e", "TPU v5p": "tpu_v5p", "TPU v6 lite": "tpu_v6e"}
  for kind, name in kinds.items():
    assert hardware.from_device_kind(kind).name == name
  assert hardware.get("H100").peak_flops["bfloat16"] == 989.4e12
  assert hardware.get("v5e").name == "tpu_v5e"
  with pytest.raises(ValueError, match="unknown hardware"):
    hardware.get("abacus")


def test_catalogue_is_extendable_from_json(tmp_path):
  path = tmp_path / "hw.json"
  path.write_text(json.dumps({"my_gpu": {"peak_flops": {"bfloat16": 5e14}, "hbm_bytes": 4.8e10,
                                         "intra_host_bw": 2e11, "inter_host_bw": 2.5e10,
                                         "devices_per_host": 4, "device_kinds": ["My GPU"]}}))
  try:
    assert hardware.load_file(str(path)) == ["my_gpu"]
    assert hardware.from_device_kind("Acme My GPU 48GB").peak_flops["bfloat16"] == 5e14
  finally:
    hardware.CATALOGUE.pop("my_gpu", None)
  path.write_text(json.dumps({"bad": {"peak_flops": {}}}))
  with pytest.raises(ValueError, match="missing"):
    hardware.load_file(str(path))


def test_cpu_peak_is_stable_and_shared_among_emulated_devices():
  peak = hardware.measure_matmul_peak("float32", size=256, seconds=0.2)
  assert peak > 1e8  # any CPU of this decade does >0.1 GFLOP/s
  per_device, source = hardware.peak_flops_per_device(jax.devices("cpu")[0])
  machine, machine_source = hardware.cpu_peak_flops()  # theoretical, from /proc/cpuinfo: stable
  assert source == machine_source and per_device == pytest.approx(machine / len(jax.devices("cpu")))
  cpuinfo = ("processor\t: 0\nmodel name\t: Xeon @ 2.00GHz\ncpu MHz\t\t: 1200.0\nphysical id\t: 0\n"
             "core id\t\t: 0\nflags\t\t: sse2 avx avx2 fma avx512f\n\n"
             "processor\t: 1\nmodel name\t: Xeon @ 2.00GHz\ncpu MHz\t\t: 1200.0\nphysical id\t: 0\n"
             "core id\t\t: 0\nflags\t\t: sse2 avx avx2 fma avx512f\n")  # two hyper-threads of one core
  assert hardware.cpu_peak_from_cpuinfo(cpuinfo, {0, 1})[0] == 1 * 2.0e9 * 64
