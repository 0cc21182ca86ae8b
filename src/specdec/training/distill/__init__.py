"""Distil a small draft model from the target (DistillSpec, Zhou et al. 2023, arXiv 2310.08461).

The student is the target's own architecture with fewer layers (and optionally a narrower hidden
size), trained on self-distilled data (the target's answers, :mod:`specdec.training.data`) to
match the target's next-token distribution p at every response position.

Why KL(p || q) rather than cross entropy on the sampled tokens: speculative decoding accepts a
drafted token with probability sum_x min(p(x), q(x)) = 1 - TV(p, q) (sampling) or when the
draft's argmax is the target's argmax (greedy). Both depend on the whole of q matching p, and
DistillSpec shows that training on the teacher's distribution (on the teacher's own outputs)
raises acceptance more than cross entropy on one sampled token per position, which only sees
p through a single draw. Cross entropy on the target's (greedy) tokens can be mixed in with
``ce_weight``. The teacher distribution comes from a no-grad forward of the target per batch
(temperature 1), evaluated only at response positions; with ``teacher_topk=k`` the target
instead runs once over the training data and its k most likely tokens per position are cached
(the rest of p kept as one tail bucket), which saves the target's forward (about half the cost
of a step) on every later epoch. Held-out figures always use the exact, full p.

Initialisation: when the student keeps the target's hidden size it starts as the target's
embeddings, first ``layers`` decoder layers, final norm and LM head, which is exactly the
untrained early-exit draft (``draft:layers:N``); training starts from that draft's acceptance.
Its embeddings and LM head then stay frozen by default (``train_embeddings``): they are most
of its weights, and the layers learn to land in the space the target's head reads. A narrower
student starts from random weights and trains everything.

Output: an ordinary Hugging Face model directory (config.json, model.safetensors, tokenizer,
generation_config.json) that ``specdec generate --speculator draft:DIR`` and
``model.generate(assistant_model=...)`` load, plus ``specdec_training.json`` (the target's
identity, the data, the settings and the held-out agreement) and ``checkpoint/`` (the shared
format of :mod:`specdec.training.checkpoint`) for ``resume=True``.

Modules: :mod:`.student` (building and initialising it), :mod:`.batches` (padding and each
epoch's batch plan), :mod:`.teacher` (forwards at the loss positions, the top-k cache),
:mod:`.loss`, :mod:`.export` (the model directory and training record) and :mod:`.trainer` (the
settings and :func:`train_draft`, a task of the shared loop, :mod:`specdec.training.loop`).
"""

from specdec.training.distill.batches import Batch, batch_plan, collate
from specdec.training.distill.export import TRAINING_FILE, export_draft, write_training_record
from specdec.training.distill.loss import LossParts, distill_loss, topk_distill_loss
from specdec.training.distill.student import build_student, freeze_embeddings, student_config
from specdec.training.distill.teacher import (
    TopKCache,
    build_topk_cache,
    response_logits,
    teacher_logits,
)
from specdec.training.distill.trainer import (
    DistillConfig,
    DistillResult,
    EvalPoint,
    evaluate,
    train_draft,
)

__all__ = [
    "TRAINING_FILE",
    "Batch",
    "DistillConfig",
    "DistillResult",
    "EvalPoint",
    "LossParts",
    "TopKCache",
    "batch_plan",
    "build_student",
    "build_topk_cache",
    "collate",
    "distill_loss",
    "evaluate",
    "export_draft",
    "freeze_embeddings",
    "response_logits",
    "student_config",
    "teacher_logits",
    "topk_distill_loss",
    "train_draft",
    "write_training_record",
]
