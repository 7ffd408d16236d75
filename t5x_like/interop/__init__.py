"""Checkpoint interchange with Hugging Face: config and tensor mapping, safetensors I/O, import and export."""
