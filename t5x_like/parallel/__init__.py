"""Axis names, the mesh, the one logical→mesh rules table and layout validator, multi-host start-up, host offload."""
