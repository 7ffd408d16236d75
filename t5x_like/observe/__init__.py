"""Metric writers, FLOPs/MFU, Prometheus, profiling, plots."""
