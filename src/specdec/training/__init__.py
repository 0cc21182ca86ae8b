"""Training pipelines for speculators: self-distilled data, feature extraction, trainers.

A leaf package: the engine never imports it. Functions here never print; they report progress
through a tqdm-compatible ``progress`` factory that the CLI supplies.

Every trainer runs the one loop of :mod:`specdec.training.loop` (schedule, optimiser step,
evaluation and checkpoint cadence, exact resumption) and writes the one checkpoint format of
:mod:`specdec.training.checkpoint`; each supplies only its module, loss and evaluation.
"""

from specdec.training.data import (
    DataManifest,
    Record,
    SelfDistilledData,
    generate_data,
    load_data,
    load_prompts,
)

__all__ = [
    "DataManifest",
    "Record",
    "SelfDistilledData",
    "generate_data",
    "load_data",
    "load_prompts",
]
