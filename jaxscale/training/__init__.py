"""Training runs: the configuration, the loop, its hooks (checkpoints, the spike guard,
faults, evaluation, metrics), the supervisor and learning-rate sweeps.

Imports `parallel`, `model`, `runtime` and the leaves (`data`, `garden`, `report`).
"""
