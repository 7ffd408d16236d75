"""Text → tokens → TFRecord shards (preprocessing) and shards → batches (the tf.data pipeline)."""
