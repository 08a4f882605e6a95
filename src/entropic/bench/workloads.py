"""The ablation's workload: four task families in one Poisson stream.

- chat: ShareGPT first turns; output length = the reference reply's length (capped), EOS
  ignored, so every configuration does the same decode work (the performance workload);
- xsum: one-sentence summaries of BBC articles (BIG-bench gem/xsum), scored against the
  reference summaries;
- aclsum: summaries of ACL papers (long context, the document cut to a token budget),
  scored against the challenge/approach/outcome reference;
- strategyqa: yes/no questions (BIG-bench), scored by accuracy;
- longdoc: summaries of long documents (ACLSum paper bodies, scored against their
  abstracts, and Shakespeare acts, compared with the baseline's text only) cut to 4k-8k
  tokens, with long outputs of equal length in every configuration (EOS ignored).
The task families but chat and longdoc stop at EOS (or max_tokens), as a user would see them.

Three regimes (`REGIMES`, docs/ablation.md): (a) "mixed", the four short families
saturating the engine; (b) "long", long documents under KV-memory pressure; (c)
"interactive", the mixed families arriving slower than the engine serves them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from entropic.bench.datasets import (load_aclsum, load_longdocs, load_sharegpt_prompts,
                                     load_strategyqa, load_xsum, user_prompt_ids)
from entropic.bench.loadgen import poisson_offsets

KINDS = ("chat", "xsum", "aclsum", "strategyqa", "longdoc")
XSUM_PROMPT = "Summarize the following news article in one sentence.\n\n{article}"
ACLSUM_PROMPT = ("Summarize this paper in three sentences: the challenge it addresses, its "
                 "approach, and its outcome.\n\n{title}\n\n{document}")
STRATEGYQA_PROMPT = "Answer the question with yes or no.\n\nQuestion: {question}"
LONGDOC_PROMPT = ("Summarize the following text in a few paragraphs: what it is about and its "
                  "main points.\n\n{title}\n\n{document}")


@dataclass(frozen=True)
class WorkloadSpec:
    """How many requests of each kind, their output caps, the long-context budget, the rate."""

    chat: int = 40
    chat_max_tokens: int = 96
    xsum: int = 16
    xsum_max_tokens: int = 48
    aclsum: int = 6
    aclsum_max_tokens: int = 96
    aclsum_context: int = 1200  # tokens of the paper kept (the prompt adds ~40)
    strategyqa: int = 40
    strategyqa_max_tokens: int = 8
    longdoc: int = 0  # long documents, papers and plays in turn
    longdoc_max_tokens: int = 128
    longdoc_contexts: tuple[int, ...] = (4096, 6144, 7936)  # document tokens, in turn
    rate: float = 3.0  # Poisson arrivals per second, all kinds together

    def __post_init__(self) -> None:
        if self.longdoc and not self.longdoc_contexts:
            raise ValueError("longdoc_contexts must not be empty")
        for k in ("chat", "xsum", "aclsum", "strategyqa", "longdoc"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k} must be >= 0, got {getattr(self, k)}")
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")


FULL = WorkloadSpec()
QUICK = WorkloadSpec(chat=8, chat_max_tokens=32, xsum=4, xsum_max_tokens=32, aclsum=2,
                     aclsum_max_tokens=32, aclsum_context=768, strategyqa=8, rate=4.0)


@dataclass(frozen=True)
class Regime:
    """A workload and the engine limits it runs under (full and --quick sizes)."""

    name: str
    description: str
    full: WorkloadSpec
    quick: WorkloadSpec
    num_kv_blocks: int = 400
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512


REGIMES = {
    "mixed": Regime("mixed", "(a) chat, summaries, long-ish papers and short answers in one "
                    "saturating Poisson stream; little KV pressure", FULL, QUICK),
    # 8 documents of 4k-8k tokens need ~3,100 blocks; 1,024 (16k tokens) hold 2-3 at once
    "long": Regime("long", "(b) summaries of 4k-8k-token documents arriving together, 128 "
                   "output tokens each, a KV pool that holds 2-3 of them at once",
                   WorkloadSpec(chat=0, xsum=0, aclsum=0, strategyqa=0, longdoc=8, rate=1.0),
                   WorkloadSpec(chat=0, xsum=0, aclsum=0, strategyqa=0, longdoc=4,
                                longdoc_contexts=(4096,), rate=2.0),
                   num_kv_blocks=1024, max_num_seqs=8),
    "interactive": Regime("interactive", "(c) the mixed families arriving slower than the "
                          "engine serves them (unsaturated: latency matters, not throughput)",
                          WorkloadSpec(chat=16, xsum=6, aclsum=2, strategyqa=16, rate=0.5),
                          WorkloadSpec(chat=6, chat_max_tokens=32, xsum=2, xsum_max_tokens=32,
                                       aclsum=1, aclsum_max_tokens=32, aclsum_context=768,
                                       strategyqa=6, rate=0.7)),
}


@dataclass(frozen=True)
class WorkItem:
    """One request of the workload, identical in every configuration."""

    key: str  # "<kind>:<source id>"
    kind: str
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    reference: str | None = None  # summary to score against (xsum, aclsum, chat)
    answer: str | None = None  # "yes" / "no" (strategyqa)


def _chat(tokenizer, text: str) -> list[int]:
    """The request as one user turn of the model's chat template; a model without one (a
    base model, Gemma 3 270M) continues the raw text instead (`prompt_format`)."""
    return user_prompt_ids(tokenizer, text)


def prompt_format(tokenizer) -> str:
    """"chat" where the model has a chat template, else "raw"."""
    return "chat" if tokenizer.chat_template else "raw"


def build_items(tokenizer, spec: WorkloadSpec, max_prompt_tokens: int = 512) -> list[WorkItem]:
    """The workload's requests, in a fixed order (kinds grouped; `timed` interleaves them)."""
    items: list[WorkItem] = []
    n = 0
    for rec in load_sharegpt_prompts():
        if n == spec.chat:
            break
        ids = _chat(tokenizer, rec["prompt"])
        if len(ids) > max_prompt_tokens:
            continue
        out_len = max(8, min(spec.chat_max_tokens, len(tokenizer.encode(rec["reference"]))))
        items.append(WorkItem(f"chat:{rec['id']}", "chat", ids, out_len, True, rec["reference"]))
        n += 1
    for rec in load_xsum(spec.xsum):
        ids = _chat(tokenizer, XSUM_PROMPT.format(article=rec["article"]))
        items.append(WorkItem(f"xsum:{rec['id']}", "xsum", ids, spec.xsum_max_tokens, False,
                              rec["reference"]))
    for rec in load_aclsum(spec.aclsum):
        doc_ids = tokenizer.encode(rec["document"])[:spec.aclsum_context]
        ids = _chat(tokenizer, ACLSUM_PROMPT.format(title=rec["title"],
                                                    document=tokenizer.decode(doc_ids)))
        items.append(WorkItem(f"aclsum:{rec['id']}", "aclsum", ids, spec.aclsum_max_tokens,
                              False, rec["reference"]))
    for rec in load_strategyqa(spec.strategyqa):
        ids = _chat(tokenizer, STRATEGYQA_PROMPT.format(question=rec["question"]))
        items.append(WorkItem(f"strategyqa:{rec['id']}", "strategyqa", ids,
                              spec.strategyqa_max_tokens, False, answer=rec["answer"]))
    if spec.longdoc:
        papers, plays = load_longdocs("paper"), load_longdocs("play")
        docs = [d for pair in zip(papers, plays) for d in pair]
        if spec.longdoc > len(docs):
            raise ValueError(f"longdoc: {spec.longdoc} requested, {len(docs)} documents packaged")
        for i, rec in enumerate(docs[:spec.longdoc]):
            context = spec.longdoc_contexts[i % len(spec.longdoc_contexts)]
            doc_ids = tokenizer.encode(rec["text"])[:context]
            ids = _chat(tokenizer, LONGDOC_PROMPT.format(title=rec["title"],
                                                         document=tokenizer.decode(doc_ids)))
            items.append(WorkItem(f"longdoc:{rec['id']}", "longdoc", ids,
                                  spec.longdoc_max_tokens, True, rec["reference"]))
    return items


def timed(items: list[WorkItem], rate: float, seed: int) -> list[tuple[float, WorkItem]]:
    """A random interleaving of the items with Poisson arrival offsets (seeded)."""
    rng = random.Random(seed)
    order = list(items)
    rng.shuffle(order)
    return list(zip(poisson_offsets(len(order), rate, rng), order))


# ---------------------------------------------------------------- prefix-caching workloads
def chat_conversations(recs: list[dict], conversations: int, turns: int, first_chars: int,
                       turn_chars: int) -> list[list[str]]:
    """User turns of `conversations` multi-turn chats: a ShareGPT first turn cut to
    first_chars, then turns-1 follow-ups (other prompts, cut to turn_chars: a chat's
    follow-ups are usually shorter than its opening). `recs` from load_sharegpt_prompts(500)."""
    follow = [r["prompt"][:turn_chars] for r in recs[200:]]
    return [[recs[c]["prompt"][:first_chars]] + follow[c * (turns - 1):(c + 1) * (turns - 1)]
            for c in range(conversations)]


def add_prefix_workload_args(ap) -> None:
    """The options of `chat_conversations` and `shared_system_prompts` (and their output
    lengths and rounds), as the prefix-caching benchmarks take them."""
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-chars", type=int, default=1500)
    ap.add_argument("--turn-chars", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=48, help="chat reply length cap")
    ap.add_argument("--requests", type=int, default=64, help="system-prompt requests")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--system-max-tokens", type=int, default=16)


def shared_system_prompts(tokenizer, recs: list[dict], requests: int,
                          system_tokens: int) -> list[list[int]]:
    """`requests` chat prompts that share one ~system_tokens-token system prompt (ShareGPT
    text from the end of `recs`), each with its own ShareGPT question (recs[100:])."""
    sys_ids, i = [], len(recs) - 1
    while len(sys_ids) < system_tokens:
        sys_ids += tokenizer.encode(recs[i]["prompt"] + "\n")
        i -= 1
    system = tokenizer.decode(sys_ids[:system_tokens])
    return [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                           {"role": "user", "content": r["prompt"][:200]}])
            for r in recs[100:100 + requests]]
