"""Grading answers, the same wherever they come from: `task_accuracy` is the one grading of a task's answers (`make
evaluate` grades answers generated in process, the smoke test answers served over HTTP: pipeline/smoke.py), and
`text_metrics` the fixed prompts' answers. Plain Python: nothing of paddle is loaded for it."""
from __future__ import annotations

from collections import Counter

import numpy as np


def task_accuracy(task: list[dict], answers: list[str | None]) -> dict:
    """Answers (None: refused) graded against the task's expected answers, exact match after stripping: accuracy,
    the graded rows, and for a classification task (2-10 distinct answers) each expected answer's recall and their
    mean, the balanced accuracy."""
    graded = [{"prompt": t.get("prompt", ""), "answer": a, "expected": t["answer"],
               "correct": a is not None and a.strip() == t["answer"]} for t, a in zip(task, answers, strict=True)]
    right = sum(g["correct"] for g in graded)
    expected = Counter(t["answer"] for t in task)
    score = {"accuracy": right / max(len(task), 1), "right": right, "total": len(task), "graded": graded,
             "given": Counter(answers), "recall": {}, "balanced": None}
    if 1 < len(expected) <= 10:
        score["recall"] = {e: (sum(g["correct"] for g in graded if g["expected"] == e) / n, n)
                           for e, n in sorted(expected.items())}
        score["balanced"] = sum(r for r, _ in score["recall"].values()) / len(expected)
    return score


def text_metrics(answers: list[dict]) -> dict:
    def ngrams(ids, n):
        return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]

    one = [g for a in answers for g in ngrams(a["token_ids"], 1)]
    two = [g for a in answers for g in ngrams(a["token_ids"], 2)]
    repeats = sum(sum(1 for x, y in zip(a["token_ids"], a["token_ids"][1:]) if x == y) for a in answers)
    steps = sum(max(len(a["token_ids"]) - 1, 0) for a in answers)
    return {"distinct_1": len(set(one)) / max(len(one), 1), "distinct_2": len(set(two)) / max(len(two), 1),
            "repetition_rate": repeats / max(steps, 1),
            "mean_length": float(np.mean([len(a["token_ids"]) for a in answers]))}
