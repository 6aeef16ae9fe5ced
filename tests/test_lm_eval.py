"""lm-evaluation-harness as its users run it against a server: `local-completions` with
`tokenizer_backend=remote` (the server's /tokenizer_info, /tokenize and /detokenize stand in for a local
tokenizer) scores a small multiple-choice task, and each choice's loglikelihood equals transformers' own.

Rules: a live server on 127.0.0.1 port 0 over a tiny transformers checkpoint built here; a task and its data
written to the test's folder (nothing fetched); lm_eval runs in a worker thread, as a client process would;
the reference is transformers' forward over the ids transformers' tokenizer gives.
"""

import json

import pytest
import torch
import trio
from transformers import PreTrainedTokenizerFast

import tiny
from lanes.gpu.device import choose
from lanes.loader import load_model
from server_helpers import serving, torch_service

DOCS = [
    {"question": "the cat sat on the", "choices": ["mat", "hat", "roof of the house"], "answer": 0},
    {"question": "in the heat of ", "choices": ["the day", "night", "it"], "answer": 1},
    {"question": "a tin can ", "choices": ["rattles", "sings", "is on the shelf"], "answer": 2},
]
TASK = """task: lanes_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def reference_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """lm_eval's pair encoding (the context's trailing spaces go to the continuation; the continuation is
    what the whole adds to the context's ids), scored by transformers' forward."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return float(sum(logprobs[i - 1, whole[i]] for i in range(len(context_ids), len(whole))))


async def test_lm_eval_scores_a_task_through_the_server_with_its_remote_tokenizer_as_transformers_would(tmp_path, monkeypatch):
    import lm_eval  # in the test extra
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    reference = tiny.build("llama", tmp_path / "model", max_position_embeddings=512).eval()
    model = load_model(tmp_path / "model", choose("cpu", "fp32"), kv_blocks=200, quiet=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "model" / "tokenizer.json"))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "task.yaml").write_text(TASK.format(data=tmp_path / "data.jsonl"))
    async with serving(torch_service(model, max_model_len=256)) as url:
        def evaluate():
            return lm_eval.simple_evaluate(
                model="local-completions",
                model_args=f"base_url={url}/v1/completions,model=tiny,tokenizer_backend=remote,max_retries=1",
                tasks=["lanes_tiny_choice"], task_manager=TaskManager(include_path=str(tmp_path / "tasks"),
                                                                       include_defaults=False),
                log_samples=True, batch_size=1)

        with trio.fail_after(120):
            results = await trio.to_thread.run_sync(evaluate)
    samples = results["samples"]["lanes_tiny_choice"]
    assert len(samples) == len(DOCS)
    scored = 0
    for sample in samples:
        for (context, continuation), ((loglikelihood, _),) in zip(sample["arguments"], sample["resps"], strict=True):
            expected = reference_loglikelihood(reference, tokenizer, context, continuation)
            assert loglikelihood == pytest.approx(expected, abs=1e-4), (context, continuation)
            scored += 1
    assert scored == sum(len(doc["choices"]) for doc in DOCS)
    assert "acc,none" in results["results"]["lanes_tiny_choice"]
