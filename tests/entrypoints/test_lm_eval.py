"""lm-evaluation-harness, unmodified, against a served model: its `local-completions` model (echo +
logprobs on /v1/completions, a real server) and its `hf` model (transformers, float32) on the
same weights score the same tasks — a multiple-choice task (same accuracy, each choice's
log-likelihood within 1e-3) and a `loglikelihood_rolling` (perplexity) task (within 1e-3
relative). The tasks are defined here from small JSONL files (lm-eval's `dataset_path: json`),
so nothing is downloaded. The tiny random model keeps it cheap; its tokenizer names every id
("w123")."""

from __future__ import annotations

import json
import random

import pytest

from server_utils import TINY, TINY_SERVER_MAX_MODEL_LEN
from engine.test_logprobs import tiny_dir  # noqa: F401 (fixture)

NUM_DOCS = 8


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(3, 512)}" for _ in range(n))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """Two lm-eval tasks over JSONL files written here."""
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    rng = random.Random(0)
    mc = [
        {
            "question": _words(rng, 6),
            "choices": [_words(rng, rng.randrange(1, 4)) for _ in range(4)],
            "answer": rng.randrange(4),
        }
        for _ in range(NUM_DOCS)
    ]
    rolling = [{"text": _words(rng, rng.randrange(10, 40))} for _ in range(NUM_DOCS // 2)]
    for name, rows in (("mc", mc), ("rolling", rolling)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: test\n"
    (d / "plp_mc.yaml").write_text(
        f"task: plp_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {d / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    (d / "plp_rolling.yaml").write_text(
        f"task: plp_rolling\n{common}dataset_kwargs:\n  data_files:\n    test: {d / 'rolling.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n"
    )
    return d


def _evaluate(model: str, model_args: dict, task_dir) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)  # not lm-eval's thousands
    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["plp_mc", "plp_rolling"],
        task_manager=tasks,
        log_samples=True,
        batch_size=1,
        device="cpu",
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def _loglikelihoods(results: dict, task: str) -> dict[int, list[float]]:
    """doc id -> the log-likelihood of each of its requests (choices, or rolling windows summed)."""
    return {
        s["doc_id"]: [float(r[0]) if isinstance(r, (list, tuple)) else float(r) for r in s["filtered_resps"]]
        for s in results["samples"][task]
    }


@pytest.mark.timeout(300)
def test_local_completions_equal_hf(tiny_dir, tiny_shared_server, task_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(task_dir / "datasets_cache"))
    max_length = TINY_SERVER_MAX_MODEL_LEN - 1  # rolling windows that fit the served context
    served = _evaluate(
        "local-completions",
        {
            "model": TINY,
            "base_url": tiny_shared_server.url + "/v1/completions",
            "tokenizer": tiny_dir,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "num_concurrent": 1,
            "max_retries": 1,
            "max_length": max_length,
        },
        task_dir,
    )
    hf = _evaluate("hf", {"pretrained": tiny_dir, "dtype": "float32", "max_length": max_length}, task_dir)

    for task in ("plp_mc", "plp_rolling"):
        a, b = _loglikelihoods(served, task), _loglikelihoods(hf, task)
        assert sorted(a) == sorted(b) and len(a) == (NUM_DOCS if task == "plp_mc" else NUM_DOCS // 2)
        for doc in a:
            assert len(a[doc]) == len(b[doc]), (task, doc)
            for x, y in zip(a[doc], b[doc]):
                tol = 1e-3 if task == "plp_mc" else 1e-3 * abs(y)
                assert abs(x - y) <= tol, (task, doc, x, y)
    acc = served["results"]["plp_mc"]["acc,none"]
    assert acc == hf["results"]["plp_mc"]["acc,none"]
    ppl = served["results"]["plp_rolling"]["word_perplexity,none"]
    assert ppl == pytest.approx(hf["results"]["plp_rolling"]["word_perplexity,none"], rel=1e-3)
