"""Replay chain draft-length policies offline on recorded greedy answers.

A greedy chain's outcome at each step is fixed by two things: the target's answer (recorded by
``specdec bench`` as ``token_ids``) and the draft's prediction at every position of it. While a
draft agrees with the answer its context *is* the answer's prefix, so one teacher-forced draft
forward over prompt + answer gives, for every output position j, the token the draft would
propose there and its confidence (the top of its softmax). A step that starts with c answer tokens
committed and drafts k accepts the run of agreements from c, at most k, and commits that run plus
the target's own token. So any policy that chooses k (or stops on confidence) can be replayed
exactly, step by step, and priced with the calibrated verification curve T(n) and the measured
seconds per drafted token, in seconds instead of an hour of benchmark per policy.

Approximations (stated in the report): a confidence read after the first disagreement comes from
the answer's prefix, not the draft's own wrong token; the reduced head's context extras are the
prompt and the answer before the position; prices are the calibration's, not the run's drift.

    python experiments/draft-policy/chain_policy.py trace \
        --results experiments/draft-model/bench-qwen-pair-vocab/results.jsonl \
        --questions experiments/draft-model/bench-qwen-pair-cheap-draft/questions.jsonl \
        --draft qwen2.5-coder-0.5b --out experiments/draft-policy/chain-policy/trace.jsonl
    python experiments/draft-policy/chain_policy.py simulate \
        --trace experiments/draft-policy/chain-policy/trace.jsonl \
        --cost experiments/draft-policy/chain-policy/cost-epyc-fp32-2threads.json --draft-ratio 0.21
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

Policy = Callable[["Replay"], "Chooser"]


# -- trace ------------------------------------------------------------------------------------
def trace(args: argparse.Namespace) -> None:
    import torch
    from tqdm import tqdm

    from specdec.bench.harness import encode_questions
    from specdec.bench.workloads import load_questions
    from specdec.speculators.draft_model import DEFAULT_DRAFT_VOCAB
    from specdec.speculators.draft_vocab import SubsetHead, draft_vocabulary, with_subset_head
    from specdec.target.loading import load_model

    torch.set_num_threads(args.threads)
    records = [json.loads(line) for line in open(args.results)]
    plain = {r["question_id"]: r for r in records if r["method"] == "none"}
    dataset = load_questions(args.questions)
    draft = load_model(args.draft, dtype=args.dtype)
    size = int(draft.model.config.vocab_size)
    keep = {*draft.tokenizer.all_special_ids, *draft.eos_token_ids}
    ids = draft_vocabulary(draft.tokenizer, args.vocab or DEFAULT_DRAFT_VOCAB, size, keep)
    model = with_subset_head(draft.model, ids, draft.dtype_name)
    head = model.get_output_embeddings()
    assert isinstance(head, SubsetHead)
    kept = set(ids.tolist())
    questions = [q for q in dataset.questions if q.question_id in plain]
    prompts = encode_questions(draft, questions, None)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w") as f:
        for q, prompt in tqdm(list(zip(questions, prompts, strict=True)), desc="tracing"):
            rec = plain[q.question_id]
            answer = list(rec["token_ids"])
            if len(prompt) != rec["prompt_tokens"]:
                raise SystemExit(f"question {q.question_id}: prompt tokens differ from the run's")
            seq = prompt + answer
            head.include(seq)
            with torch.inference_mode():
                logits = model(torch.tensor([seq])).logits[0, len(prompt) - 1 : -1].float()
            seen = set(prompt)
            tokens, confidence = [], []
            for j, row in enumerate(logits):  # row j predicts answer[j]
                banned = [t for t in head._extra if t not in seen and t not in kept]
                if banned:
                    row = row.clone()
                    row[banned] = float("-inf")
                p = torch.softmax(row, -1)
                top = int(p.argmax())
                tokens.append(top)
                confidence.append(round(float(p[top]), 5))
                seen.add(answer[j])
            f.write(
                json.dumps(
                    {
                        "question_id": q.question_id,
                        "group": rec["group"],
                        "answer": answer,
                        "draft": tokens,
                        "confidence": confidence,
                    }
                )
                + "\n"
            )


# -- replay -----------------------------------------------------------------------------------
@dataclass
class Prices:
    """Verification cost T(n)/T(1) of an n-node chain, and a drafted token's cost in T(1)."""

    ratios: dict[int, float]
    draft: float

    def verify(self, n: int) -> float:
        if n in self.ratios:
            return self.ratios[n]
        top = max(self.ratios)
        slope = (self.ratios[top] - self.ratios[max(1, top - 8)]) / max(1, min(8, top - 1))
        return self.ratios[top] + slope * (n - top)


@dataclass
class Replay:
    answer: list[int]
    draft: list[int]
    confidence: list[float]
    prices: Prices

    def run(self, chooser: Chooser, cap: int) -> dict[str, float]:
        """Steps of the policy over the answer: time (in T(1)), steps, drafted tokens."""
        n = len(self.answer)
        c, time, steps, drafted, accepted_total = 1, self.prices.verify(1), 1, 0, 0
        while c < n:
            room = min(cap, n - c - 1)
            made, forwards = chooser.draft(self, c, room)
            run = 0
            while run < made and self.draft[c + run] == self.answer[c + run]:
                run += 1
            chooser.observe(c, made, run)
            time += self.prices.verify(made + 1) + self.prices.draft * forwards
            drafted += made
            accepted_total += run
            steps += 1
            c += run + 1
        return {"time": time, "steps": steps, "drafted": drafted, "accepted": accepted_total}


class Chooser:
    """A policy: ``length`` before drafting, ``go_on`` after each drafted token, ``observe``
    what verification accepted."""

    def draft(self, r: Replay, c: int, room: int) -> tuple[int, int]:
        """(tokens drafted, draft forwards run) for the step at ``c``."""
        k = self.length(c, room)
        made = 0  # the chooser may end the chain early, token by token
        while made < k:
            made += 1
            if not self.go_on(c, made, r.confidence[c + made - 1]):
                break
        return made, made

    def length(self, c: int, room: int) -> int:
        return room

    def go_on(self, c: int, made: int, confidence: float) -> bool:
        return True

    def observe(self, c: int, drafted: int, accepted: int) -> None:
        pass


class Fixed(Chooser):
    def __init__(self, k: int, threshold: float = 0.0) -> None:
        self.k, self.threshold = k, threshold

    def length(self, c: int, room: int) -> int:
        return min(self.k, room)

    def go_on(self, c: int, made: int, confidence: float) -> bool:
        return confidence >= self.threshold


class Oracle(Chooser):
    """Drafts exactly the run the target will accept (the ceiling of any stopping rule)."""

    def __init__(self, replay: Replay) -> None:
        self.r = replay

    def length(self, c: int, room: int) -> int:
        run = 0
        while run < room and self.r.draft[c + run] == self.r.answer[c + run]:
            run += 1
        return run


class Adaptive(Chooser):
    """specdec's AdaptiveBudget (the engine's chain default), with frozen prices."""

    def __init__(self, prices: Prices, k: int) -> None:
        from specdec.control.budget import AdaptiveBudget, CostModel

        ratios = {n: prices.verify(n) for n in range(1, k + 2)}
        costs = CostModel(chain_ratios=ratios, frozen=True, draft_seconds_per_token=prices.draft)
        self.budget = AdaptiveBudget(k, costs)

    def length(self, c: int, room: int) -> int:
        return self.budget.choose(room + 1, 10**6)

    def observe(self, c: int, drafted: int, accepted: int) -> None:
        self.budget.observe(drafted, accepted)


class Calibrated(Chooser):
    """Learns as the draft model does: its confidence calibration (shared across requests)
    and the request's acceptance of a first token, from the tokens verification tested."""

    def __init__(self, prices: Prices, calibration: object, depth: int) -> None:
        self.prices, self.cal, self.depth = prices, calibration, depth
        self.alpha = 0.7
        self._confs: list[float] = []

    def observe(self, c: int, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, accepted + 1)):
            hit = i < accepted
            self.cal.update(self._confs[i], hit)
            if i == 0:
                self.alpha = 0.8 * self.alpha + 0.2 * (1.0 if hit else 0.0)


class Marginal(Calibrated):
    """``length=auto``: one more forward while the token it adds is worth more per target step
    than the request's long-run rate (a moving average of committed tokens per target step)."""

    def __init__(
        self, prices: Prices, calibration: object, depth: int = 12, scale: float = 1.0
    ) -> None:
        super().__init__(prices, calibration, depth)
        self.scale = scale
        self.rate = 1.0 / prices.verify(1)

    def draft(self, r: Replay, c: int, room: int) -> tuple[int, int]:
        if room < 1:
            return 0, 0
        verify, fwd = self.prices.verify, self.prices.draft
        values = [1.0]
        top = min(self.depth, room)
        for d in range(1, top + 1):
            values.append(values[-1] * self.cal.estimate(r.confidence[c + d - 1]))
            if d == top:
                break
            marginal = values[-1] * self.alpha / max(1e-6, fwd + verify(d + 2) - verify(d + 1))
            if marginal <= self.scale * self.rate:
                break
        n = len(values) - 1
        self._confs = [r.confidence[c + i] for i in range(n)]
        self._cost = verify(n + 1) + fwd * n
        return n, n

    def observe(self, c: int, drafted: int, accepted: int) -> None:
        super().observe(c, drafted, accepted)
        if drafted:
            self.rate = 0.9 * self.rate + 0.1 * (accepted + 1) / self._cost


class Priced(Calibrated):
    """The draft model's tree rule with width 1: one more forward while the token it adds
    (worth the chain's value so far times the request's acceptance) raises expected tokens per
    second, values from the draft's calibrated confidence; then the prefix that pays best."""

    def draft(self, r: Replay, c: int, room: int) -> tuple[int, int]:
        from specdec.speculators.draft_model import _best_prefix

        if room < 1:
            return 0, 0
        verify, fwd = self.prices.verify, self.prices.draft
        values, forwards = [1.0], 1
        for d in range(1, min(self.depth, room) + 1):
            values.append(values[-1] * self.cal.estimate(r.confidence[c + d - 1]))
            if d == min(self.depth, room):
                break
            gain = sum(values[1:])
            now = (1.0 + gain) / (verify(len(values)) + fwd * forwards)
            nxt = (1.0 + gain + values[-1] * self.alpha) / (
                verify(len(values) + 1) + fwd * (forwards + 1)
            )
            if nxt <= now:
                break
            forwards += 1
        keep = _best_prefix(values, lambda n: verify(n) + fwd * forwards)
        self._confs = [r.confidence[c + i] for i in range(len(keep) - 1)]
        return len(keep) - 1, forwards


def simulate(args: argparse.Namespace) -> None:
    cal = json.loads(Path(args.cost).expanduser().read_text())
    secs = {int(n): float(s) for n, s in cal["chain_seconds"].items()}
    from specdec.control.budget import monotone

    ratios = monotone({n: s / secs[1] for n, s in secs.items()})
    prices = Prices(ratios, args.draft_ratio)
    traces = [json.loads(line) for line in open(args.trace)]
    from specdec.speculators.draft_model import _Calibration

    shared = _Calibration()  # learnt across requests, as the speculator's is; fresh per policy
    policies: dict[str, Callable[[Replay], Chooser]] = {
        "oracle (drafts exactly what is accepted)": lambda r: Oracle(r),
        "length=budget, K=5 (the previous default)": lambda r: Adaptive(prices, 5),
        "length=budget, K=16": lambda r: Adaptive(prices, 16),
        "fixed K=5": lambda r: Fixed(5),
        "fixed K=16, stop below conf 0.5": lambda r: Fixed(16, 0.5),
        "fixed K=16, stop below conf 0.7": lambda r: Fixed(16, 0.7),
        "tree=auto's rule, width 1, depth 16": lambda r: Priced(prices, shared, 16),
        "length=auto, k=8": lambda r: Marginal(prices, shared, 8),
        "length=auto (k=16)": lambda r: Marginal(prices, shared, 16),
    }
    for scale in (0.8, 1.2, 1.5):
        policies[f"length=auto, rate x{scale}"] = lambda r, sc=scale: Marginal(
            prices, shared, 16, sc
        )
    groups = sorted({t["group"] for t in traces})
    rows = []
    for name, make in policies.items():
        shared.__dict__.update(_Calibration().__dict__)
        per_group: dict[str, list[float]] = {g: [] for g in groups}
        taus = []
        for t in traces:
            r = Replay(t["answer"], t["draft"], t["confidence"], prices)
            res = r.run(make(r), args.cap)
            plain = len(t["answer"]) * prices.verify(1)
            per_group[t["group"]].append(plain / res["time"])
            taus.append(len(t["answer"]) / res["steps"])
        gm = {g: _gmean(v) for g, v in per_group.items()}
        spec = _gmean([gm[g] for g in groups if g != "code"])
        rows.append((name, spec, gm.get("code", float("nan")), _gmean(taus), gm))
    print("| policy | Spec-Bench groups | code | τ | " + " | ".join(groups) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(groups))
    for name, spec, code, tau, gm in rows:
        cells = " | ".join(f"{gm[g]:.2f}" for g in groups)
        print(f"| {name} | {spec:.2f} | {code:.2f} | {tau:.2f} | {cells} |")


def _gmean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace")
    t.add_argument("--results", required=True)
    t.add_argument("--questions", required=True)
    t.add_argument("--draft", default="qwen2.5-coder-0.5b")
    t.add_argument("--dtype", default="int4")
    t.add_argument("--vocab", type=int, default=0)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--out", required=True)
    s = sub.add_parser("simulate")
    s.add_argument("--trace", required=True)
    s.add_argument("--cost", required=True)
    s.add_argument("--draft-ratio", type=float, default=0.21)
    s.add_argument("--cap", type=int, default=16)
    args = p.parse_args()
    trace(args) if args.cmd == "trace" else simulate(args)


if __name__ == "__main__":
    main()
