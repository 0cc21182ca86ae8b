"""Trainable speculator modules and their checkpoint I/O (no tokenizers, no decoding loops)."""

from specdec.heads.medusa import MedusaConfig, MedusaHeads, load_medusa

__all__ = ["MedusaConfig", "MedusaHeads", "load_medusa"]
