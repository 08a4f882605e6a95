"""lm-evaluation-harness against a real `entropic serve`, offline, as users run it:
`local-completions` with the server's own tokenizer (`tokenizer_backend=remote`), on the two
small tasks in tests/data/lm_eval (multiple choice by loglikelihood, and generation).

What lm-eval reports is checked against the engine itself, in this process: each
loglikelihood equals the sum of the engine's prompt logprobs over the continuation's tokens,
the accuracy equals the one those logprobs give, and each generation equals the engine's
greedy output under the same stop strings."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from entropic import SamplingParams
from serving import ServerProcess

pytestmark = pytest.mark.model
lm_eval = pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "lm_eval"
MODEL = "smollm2"  # --served-model-name


@pytest.fixture(scope="module")
def results():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(ROOT)  # the task files name their data relative to the repository root
    try:
        with ServerProcess("--threads", "1", "--dtype", "float32", "--served-model-name", MODEL,
                           "--log-level", "warning") as srv:
            return simple_evaluate(
                model="local-completions",
                model_args=f"model={MODEL},base_url={srv.base}/v1/completions,"
                           "tokenizer_backend=remote,num_concurrent=1,max_retries=1",
                tasks=["entropic_mc", "entropic_gen"], task_manager=TaskManager(
                    include_path=str(TASKS)), log_samples=True)
    finally:
        os.chdir(cwd)


def _pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into token ids: trailing
    whitespace of the context moves to the continuation, the whole is encoded, and the
    continuation is what follows the context's own encoding."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def test_loglikelihoods_and_accuracy_are_the_engines(results, llm_fp32):
    samples = results["samples"]["entropic_mc"]
    docs = [json.loads(line) for line in (TASKS / "entropic_mc.jsonl").read_text().splitlines()]
    assert len(samples) == len(docs) == 12
    tok = llm_fp32.tokenizer
    correct = 0
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        doc = docs[s["doc_id"]]
        ours = []
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            ctx, cont = _pair(tok, context, continuation)
            (out,) = llm_fp32.generate([ctx + cont], SamplingParams(max_tokens=1, temperature=0,
                                                                    prompt_logprobs=0))
            ll = sum(e.logprob for e in out.prompt_logprobs[len(ctx):])
            reported = float(resp[0][0])
            assert abs(reported - ll) < 1e-4, (continuation, reported, ll)
            ours.append(ll)
        correct += max(range(len(ours)), key=ours.__getitem__) == doc["answer"]
    acc = results["results"]["entropic_mc"]["acc,none"]
    assert acc == pytest.approx(correct / len(docs), abs=1e-12)
    assert 0 < acc < 1  # the task discriminates: neither all right nor all wrong


def test_generations_are_the_engines_greedy_outputs(results, llm_fp32):
    samples = results["samples"]["entropic_gen"]
    assert len(samples) == 6
    tok = llm_fp32.tokenizer
    for s in samples:
        context, gen_kwargs = s["arguments"][0]
        stop = list(gen_kwargs["until"])
        ids = tok.encode(context, add_special_tokens=False)
        (out,) = llm_fp32.generate([ids], SamplingParams(
            max_tokens=gen_kwargs["max_gen_toks"], temperature=0, stop=stop, seed=1234))
        assert s["resps"][0][0] == out.text
    em = results["results"]["entropic_gen"]["exact_match,last_word"]
    assert 0 < em < 1
