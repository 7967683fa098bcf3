"""Checkpoints: `manager` saves and restores through Orbax in the canonical layout; `store`
reads a checkpoint directory as plain files (never starts JAX)."""
