"""t5x_like: a TFRecord-centric GPT trainer on JAX."""
import setuptools

SERVE = ["starlette>=0.37", "uvicorn>=0.29", "prometheus_client>=0.20"]
HF = ["torch==2.13.0", "transformers>=4.45", "safetensors>=0.4", "tokenizers>=0.20"]

setuptools.setup(
    name="t5x_like",
    version="0.1.0",
    description="GPT-style language-model trainer on JAX/Flax with tf.data input and orbax checkpoints.",
    # The gin configs stay in the top-level configs/ folder of the repository and are installed as the
    # package t5x_like.configs, so `--gin_file=configs/...` resolves after a non-editable install too.
    packages=setuptools.find_packages(include=["t5x_like", "t5x_like.*"]) + ["t5x_like.configs"],
    package_dir={"t5x_like.configs": "configs"},
    package_data={"t5x_like.configs": ["**/*.gin", "tasks/*.yaml", "tasks/*.jsonl"], "t5x_like.inference": ["static/*.html"]},
    python_requires=">=3.11",
    # Lower bounds verified together on Python 3.11 (CPU): jax 0.10.2, flax 0.12.8, optax 0.2.8,
    # orbax-checkpoint 0.12.8, tensorflow-cpu 2.21.0, sentencepiece 0.2.3, etils 1.15.
    # Exactly what t5x_like/ imports.
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "tensorflow-cpu>=2.21.0",
        "sentencepiece>=0.2.0",
        "tokenizers>=0.20",  # HF tokenizer.json (preprocess / infer / evaluate --tokenizer, save_hf)
        "tensorboard>=2.21.0",  # the event files (observe/metrics.py: its event-file writer and scalar protos)
        "gin-config>=0.5.0",
        "absl-py>=2.1.0",
        "numpy>=2.0",
        "etils[epath]>=1.7",
        "jinja2>=3.1",  # convert from_hf: a model's chat template (Jinja) read into a data.ChatTemplate
        "safetensors>=0.4",  # python -m t5x_like.convert reads and writes Hugging Face weights (numpy, no torch)
        "pyarrow>=14",  # preprocess: Parquet inputs and `datasets.save_to_disk` folders (read without `datasets`)
        "zstandard>=0.22",  # preprocess: *.jsonl.zst / *.txt.zst inputs
        "datasketch>=2.0",  # preprocess --near_dedup: MinHash LSH
        "scipy>=1.11",  # python -m t5x_like.scaling fit: L-BFGS-B (already a dependency of jax)
    ],
    extras_require={
        "beam": ["apache-beam>=2.60"],  # preprocess --runner=direct|dataflow|...
        "plot": ["matplotlib>=3.8"],  # python -m t5x_like.plot
        "prometheus": ["prometheus_client>=0.20"],  # ObserveConfig.prometheus_port > 0
        "mlflow": ["mlflow>=2.10"],  # ObserveConfig.trackers has 'mlflow' (mlflow-skinny is enough without `mlflow ui`)
        "wandb": ["wandb>=0.16"],  # ObserveConfig.trackers has 'wandb'
        # python -m t5x_like.serve: the ASGI app (Starlette), its server (uvicorn) and /metrics
        "serve": SERVE,
        "eval": ["lm-eval>=0.4.13"],  # python -m t5x_like.evaluate --tasks=...: lm-evaluation-harness tasks and metrics
        # Hugging Face transformers (on torch): the reference tests/test_interop.py compares conversions with.
        # torch is pinned: that CPU wheel is on the CI machine's disk; an unpinned torch pulls a multi-GB CUDA build.
        "hf": HF,
        # Everything the tests exercise, Beam and transformers included.
        "test": ["pytest>=8.0", "pytest-xdist>=3.5", "apache-beam>=2.60", "matplotlib>=3.8", "prometheus_client>=0.20",
                 "mlflow-skinny>=2.10", "wandb>=0.16", "openai>=1.40", "lm-eval>=0.4.13"]  # openai: the real client tests/test_serve.py calls the server with
                + SERVE + HF,
    },
)
