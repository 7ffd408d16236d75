"""Downstream evaluation: lm-evaluation-harness tasks on the inference engine, after training and in the loop."""
