"""Experiments over many runs: grid sweeps of gin bindings and their reports."""
