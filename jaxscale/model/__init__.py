"""The one model: its configuration and presets, the transformer, attention kernels, the
loss, optimizers written from their equations, number formats and precision policies, FLOPs.

Imports only `runtime` and the `garden` leaf (for the vocabulary).
"""
