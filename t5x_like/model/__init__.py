"""The decoder: layers, blocks, pipeline parallelism of the layer stack, KV-cache decoding."""
