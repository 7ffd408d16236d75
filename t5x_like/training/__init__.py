"""Optimizer, precision, train state, objectives, the generic step, the loop, checkpoints, fault tolerance."""
