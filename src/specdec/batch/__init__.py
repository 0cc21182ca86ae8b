"""Batched serving: many sequences verified in one target pass (continuous batching)."""

from specdec.batch.cache import SlotCache
from specdec.batch.scheduler import (
    BatchScheduler,
    BatchSequence,
    StepReport,
    generate_batch,
    generate_batch_ids,
)
from specdec.batch.target import BatchTarget

__all__ = [
    "BatchScheduler",
    "BatchSequence",
    "BatchTarget",
    "SlotCache",
    "StepReport",
    "generate_batch",
    "generate_batch_ids",
]
