"""The one inference engine: batched ragged prefill, KV-cache decode, continuous batching, sampling, scoring."""
