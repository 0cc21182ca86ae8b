"""Writes the 28-prompt set of the fast-by-default runs as a ``specdec bench --dataset`` file:
the prompts experiments/llamacpp/llamacpp_compare.py picks with ``--per-group 3 --code 10``
(the first 3 Spec-Bench questions of each task group, the first 10 GPTeacher code-generation
instructions as ``category: code``).

    python experiments/kquant/pair28.py bench-out/pair28.jsonl
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "llamacpp"))
from llamacpp_compare import load_prompts  # noqa: E402

out = Path(sys.argv[1])
out.parent.mkdir(parents=True, exist_ok=True)
records = [
    {"question_id": p["id"], "category": p["group"], "turns": [p["text"]]}
    for p in load_prompts(3, 10)
]
out.write_text("".join(json.dumps(r) + "\n" for r in records))
print(f"{len(records)} prompts -> {out}")
