"""The packaged ShareGPT prompt subset loads deterministically and whole."""
import json

import pytest

from entropic.bench.datasets import load_sharegpt_prompts


def test_returns_n_records_with_nonempty_prompts():
    rows = load_sharegpt_prompts(32)
    assert len(rows) == 32
    for r in rows:
        assert set(r) == {"id", "prompt", "reference"}
        assert r["prompt"].strip() and r["reference"].strip()
        assert 16 <= len(r["prompt"]) <= 4000


def test_order_is_deterministic_and_prefix_stable():
    a = load_sharegpt_prompts(50)
    b = load_sharegpt_prompts(50)
    assert a == b
    assert load_sharegpt_prompts(10) == a[:10]


def test_all_records_unique():
    rows = load_sharegpt_prompts()
    assert len(rows) == 500
    assert len({r["id"] for r in rows}) == 500
    assert len({r["prompt"] for r in rows}) == 500


def test_too_many_or_negative_is_an_error():
    with pytest.raises(ValueError):
        load_sharegpt_prompts(501)
    with pytest.raises(ValueError):
        load_sharegpt_prompts(-1)


def test_explicit_path(tmp_path):
    p = tmp_path / "p.jsonl"
    recs = [{"id": str(i), "prompt": f"prompt {i}", "reference": "r"} for i in range(3)]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert load_sharegpt_prompts(path=p) == recs
    assert load_sharegpt_prompts(2, path=str(p)) == recs[:2]


def test_ablation_task_data_loads_whole():
    from entropic.bench.datasets import load_aclsum, load_strategyqa, load_xsum
    xs, acl, sqa = load_xsum(), load_aclsum(), load_strategyqa()
    assert len(xs) == 48 and len(acl) == 16 and len(sqa) == 200
    assert all(r["article"].strip() and r["reference"].strip() for r in xs)
    assert all(r["document"].strip() and r["reference"].strip() for r in acl)
    assert all(len(r["document"]) <= 6000 for r in acl)
    assert {r["answer"] for r in sqa} == {"yes", "no"}
    assert load_xsum(5) == xs[:5]
    with pytest.raises(ValueError):
        load_aclsum(17)


def test_a_model_without_chat_template_gets_the_raw_text():
    """Bench prompts: one user turn of the chat template where the model has one, else the
    raw text and a blank line (a base model continues it)."""
    from types import SimpleNamespace

    from entropic.bench.datasets import chat_prompt_ids, user_prompt_ids
    from entropic.bench.workloads import prompt_format

    seen = []
    base = SimpleNamespace(chat_template=None, encode=lambda t: seen.append(t) or [len(t)])
    chat = SimpleNamespace(chat_template="{{ messages }}",
                           apply_chat_template=lambda msgs: [7, len(msgs[0]["content"])])
    assert user_prompt_ids(base, "Summarize this.") == [len("Summarize this.\n\n")]
    assert seen == ["Summarize this.\n\n"]
    assert user_prompt_ids(chat, "Summarize this.") == [7, len("Summarize this.")]
    assert (prompt_format(base), prompt_format(chat)) == ("raw", "chat")
    first = load_sharegpt_prompts(1)[0]["prompt"]
    assert chat_prompt_ids(base, 1, max_tokens=10**6) == [[len(first) + 2]]
