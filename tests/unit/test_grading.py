"""evaluation/grading.py: the one grading of a task's answers (make evaluate's and the smoke test's)."""
from evaluation.grading import task_accuracy, text_metrics


def test_answers_are_graded_exactly_with_each_labels_recall_and_the_balanced_accuracy():
    task = [{"prompt": "a", "answer": "正面"}, {"prompt": "b", "answer": "负面"}, {"prompt": "c", "answer": "正面"},
            {"prompt": "d", "answer": "正面"}]
    score = task_accuracy(task, ["正面", " 负面 ", "负面", None])  # (None: a request the server refused)
    assert (score["right"], score["total"], score["accuracy"]) == (2, 4, 0.5)
    assert [g["correct"] for g in score["graded"]] == [True, True, False, False]
    assert score["recall"] == {"正面": (1 / 3, 3), "负面": (1.0, 1)}
    assert abs(score["balanced"] - (1 / 3 + 1) / 2) < 1e-12
    assert score["given"]["负面"] == 1 and score["given"][None] == 1


def test_an_open_task_has_no_balanced_accuracy_and_a_missing_answer_is_an_error():
    task = [{"answer": str(i)} for i in range(12)]  # (12 distinct answers: not a classification task)
    score = task_accuracy(task, [str(i) for i in range(11)] + ["x"])
    assert score["accuracy"] == 11 / 12 and score["balanced"] is None and score["recall"] == {}
    try:
        task_accuracy(task, ["0"])
    except ValueError:
        pass
    else:
        raise AssertionError("answers shorter than the task were graded")


def test_text_metrics_count_distinct_ngrams_and_repeats():
    metrics = text_metrics([{"token_ids": [1, 1, 2]}, {"token_ids": [3]}])
    assert metrics == {"distinct_1": 3 / 4, "distinct_2": 2 / 2, "repetition_rate": 1 / 2, "mean_length": 2.0}
