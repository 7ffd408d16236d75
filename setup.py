"""t5x_like: a TFRecord-centric GPT trainer on JAX."""
import setuptools

setuptools.setup(
    name="t5x_like",
    version="0.1.0",
    description="GPT-style language-model trainer on JAX/Flax with tf.data input and orbax checkpoints.",
    packages=setuptools.find_packages(include=["t5x_like", "t5x_like.*"]),
    package_data={"t5x_like": ["testdata/*"]},
    python_requires=">=3.10",
    # Lower bounds verified together on Python 3.11 (CPU): jax 0.10.2, flax 0.12.8, optax 0.2.8,
    # orbax-checkpoint 0.12.8, tensorflow-cpu 2.21.0, clu 0.0.12, sentencepiece 0.2.3.
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "tensorflow-cpu>=2.21.0",
        "sentencepiece>=0.2.0",
        "clu>=0.0.12",
        "gin-config>=0.5.0",
        "tensorboard>=2.21.0",
        "absl-py>=2.1.0",
        "numpy>=2.0",
        "matplotlib>=3.8",
        "prometheus_client>=0.20",
    ],
    extras_require={
        # apache-beam so CI runs the DirectRunner-equals-local-runner test too.
        "test": ["pytest>=8.0", "apache-beam>=2.60"],
        "beam": ["apache-beam>=2.60"],
    },
)
