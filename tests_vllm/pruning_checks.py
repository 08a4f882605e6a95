"""Checks of the pruning backend's block-table trimming, with no model: run in the vLLM venv
(tests_vllm/test_pruning_unit.py does); exits non-zero on the first failure, prints "ok".

vLLM's own CPU kernel (`cpu_attention_with_kv_cache`) runs on random K/V written through
vLLM's own `cpu_attn_reshape_and_cache` into scattered blocks, for a batch of two pruned
decode rows (one with a 1-token last block), a plain decode row and a prefill chunk:
- the blocks kept are the sink, the recent and the highest-bound others, bounds computed
  here from the keys themselves (independently of the backend's layout probe);
- each pruned row's output equals fp64 attention over exactly its kept tokens;
- the other rows' outputs are bit-identical to the unpruned kernel call's;
- a budget that keeps every block leaves the table, the lengths and the output as they were;
- a block rewritten after its bound was taken is re-bounded (the writes counter voids it);
- argument validation, the processor's per-request entropy, the counters.
"""
from __future__ import annotations

import math
import sys
import time

import torch
from vllm import SamplingParams
from vllm import _custom_ops as ops
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from entropic_vllm.pruned_attention import (BlockWrites, DecodePlan, KeyBounds, key_layout,
                                            prune_rows)
from entropic_vllm.pruning import (SHARED, PruningLogitsProcessor, PruningStats,
                                   parse_pruning)

H, KVH, D, BS, NUM_BLOCKS = 9, 3, 64, 32, 48
SCALE = 1 / math.sqrt(D)


def check(cond: bool, what: str) -> None:
    if not cond:
        print(f"FAILED: {what}")
        sys.exit(1)


def refused(extra: dict, needle: str) -> None:
    try:
        parse_pruning(extra)
    except ValueError as e:
        check(needle in str(e), f"{extra}: message {e!r} lacks {needle!r}")
        return
    check(False, f"{extra} was accepted")


def check_params() -> None:
    check(parse_pruning(None) is None and parse_pruning({"thermostat": {}}) is None, "no opt-in")
    cfg = parse_pruning({"pruning": {}})
    check(cfg is not None and cfg.score == "bound" and cfg.min_blocks == 4, "defaults")
    cfg = parse_pruning({"pruning_min_keep_fraction": 0.5, "pruning_min_blocks": 2})
    check(cfg.min_keep_fraction == 0.5 and cfg.min_blocks == 2, "flat keys")
    check(parse_pruning({"pruning_adaptive": 0}).adaptive is False, "adaptive as 0")
    refused({"pruning": {"adaptive": "no"}}, "pruning.adaptive must be true or false")
    refused({"pruning": {"score": "mass"}}, "only 'bound' on vLLM")
    refused({"pruning": {"evict": True}}, "unknown or unsupported field(s) ['evict']")
    refused({"pruning": {"min_blocks": 2.5}}, "pruning.min_blocks must be an integer")
    refused({"pruning": {"h_low": "low"}}, "pruning.h_low must be a number")
    refused({"pruning": {"min_keep_fraction": 0}}, "pruning.min_keep_fraction must be in (0, 1]")
    refused({"pruning": {"h_low": 2.0, "h_high": 1.0}}, "need 0 <= h_low < h_high")
    refused({"pruning": {}, "pruning_min_blocks": 2}, "not both")
    refused({"pruning": 3}, "must be a dict")


def check_layouts() -> None:
    isas = [("vec", torch.float32), ("vec", torch.bfloat16)]
    if torch.cpu._is_amx_tile_supported():
        isas.append(("amx", torch.bfloat16))
    for isa, dtype in isas:
        cache = torch.zeros(2, KVH, 2 * 128, D, dtype=dtype)
        kc, vc = cache.chunk(2, dim=2)
        keys = torch.randn(256, KVH, D).to(dtype)
        ops.cpu_attn_reshape_and_cache(keys, torch.zeros_like(keys), kc, vc,
                                       torch.arange(256), isa)
        layout = key_layout(isa, dtype, 128, D)
        got = kc.reshape(2, KVH, -1)[..., layout].view(2, KVH, D, 128)  # [block, h, dim, tok]
        want = keys.view(2, 128, KVH, D).permute(0, 2, 3, 1)
        check(torch.equal(got, want), f"key layout {isa} {dtype}")


class Batch:
    """Four rows over scattered blocks: decode (pruned), decode (plain), prefill chunk of 5,
    decode (pruned, its last block holding one token)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.seq = torch.tensor([300, 200, 150, 257], dtype=torch.int32)
        qlen = [1, 1, 5, 1]
        self.qsl = torch.tensor([0, 1, 2, 7, 8], dtype=torch.int32)
        perm = torch.randperm(NUM_BLOCKS, generator=g)
        per_row = [-(-int(s) // BS) for s in self.seq]
        self.table = torch.zeros(4, 12, dtype=torch.int32)
        k = 0
        for r, n in enumerate(per_row):
            self.table[r, :n] = perm[k:k + n].to(torch.int32)
            k += n
        self.cache = torch.zeros(NUM_BLOCKS, KVH, BS, 2 * D)
        self.kc, self.vc = self.cache.view(NUM_BLOCKS, KVH, 2 * BS, D).chunk(2, dim=2)
        self.keys, self.values = [], []
        for r in range(4):  # every slot of every row's context
            n = int(self.seq[r])
            kk = torch.randn(n, KVH, D, generator=g)
            kk[:, :, :4] += 3 * torch.randn(n, 1, 4, generator=g).sign()  # some structure
            vv = torch.randn(n, KVH, D, generator=g)
            self.write(r, torch.arange(n), kk, vv)
            self.keys.append(kk)
            self.values.append(vv)
        self.q = torch.randn(8, H, D, generator=g)
        self.qlen = qlen

    def slots(self, r: int, pos: torch.Tensor) -> torch.Tensor:
        return self.table[r].long()[pos // BS] * BS + pos % BS

    def write(self, r: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(k, v, self.kc, self.vc, self.slots(r, pos), "vec")

    def run(self, table: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(8, H, D)
        sched = self.schedule(seq)
        ops.cpu_attention_with_kv_cache(
            query=self.q, key_cache=self.kc, value_cache=self.vc, output=out,
            query_start_loc=self.qsl, seq_lens=seq, scale=SCALE, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0,
            scheduler_metadata=sched, s_aux=None)
        return out

    def schedule(self, seq: torch.Tensor) -> torch.Tensor:
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=4, num_heads=H, num_kv_heads=KVH, head_dim=D, seq_lens=seq,
            dtype=torch.float32, query_start_loc=self.qsl, causal=True,
            sliding_window_size=-1, isa="vec", enable_kv_split=True)

    def plan(self, keep: list[int], writes: BlockWrites, stats: PruningStats) -> DecodePlan:
        n = len(keep)
        return DecodePlan(BS, torch.tensor([0, 3])[:n], torch.tensor(keep), torch.full((n,), 1),
                          torch.full((n,), 2), writes, self.schedule, stats)


def expected_kept(b: Batch, r: int, qrow: int, keep: int, sink: int = 1,
                  recent: int = 2) -> list[int]:
    """Block indices of row r to keep, bounds straight from its keys."""
    n = int(b.seq[r])
    nb = -(-n // BS)
    k = b.keys[r].double()
    q = b.q[qrow].double().view(KVH, H // KVH, D)
    score = []
    for i in range(nb):
        blk = k[i * BS:(i + 1) * BS]  # [bs, KVH, D]
        lo, hi = blk.amin(0), blk.amax(0)  # [KVH, D]
        s = torch.maximum(q * lo[:, None], q * hi[:, None]).sum(-1)  # [KVH, rep]
        score.append(float(s.max()))
    protected = set(range(min(sink, nb))) | set(range(max(0, nb - recent), nb))
    others = sorted((i for i in range(nb) if i not in protected), key=lambda i: (-score[i], i))
    return sorted(protected | set(others[:max(0, keep - len(protected))]))


def reference(b: Batch, r: int, qrow: int, blocks: list[int]) -> torch.Tensor:
    n = int(b.seq[r])
    pos = torch.cat([torch.arange(i * BS, min((i + 1) * BS, n)) for i in blocks])
    k, v = b.keys[r][pos].double(), b.values[r][pos].double()
    q = b.q[qrow].double().view(KVH, H // KVH, D)
    att = torch.softmax(torch.einsum("hrd,thd->hrt", q, k) * SCALE, -1)
    return torch.einsum("hrt,thd->hrd", att, v).reshape(H, D)


def kept_blocks(b: Batch, table: torch.Tensor, seq: torch.Tensor, r: int) -> list[int]:
    ids = table[r, :-(-int(seq[r]) // BS)].tolist()
    return [b.table[r].tolist().index(x) for x in ids]


def check_trimming() -> None:
    b = Batch()
    dense = b.run(b.table, b.seq)
    writes, bounds, stats = BlockWrites(), KeyBounds(), PruningStats()
    layout = key_layout("vec", torch.float32, BS, D)
    keep = [4, 5]
    plan = b.plan(keep, writes, stats)
    table, seq, kept = prune_rows(b.q, b.kc, b.table, b.seq, b.qsl, plan, bounds, layout)
    check(kept.tolist() == keep, f"kept {kept.tolist()} blocks, budget {keep}")
    check(torch.equal(b.table, Batch().table), "vLLM's own block table was left as it was")
    for r, qrow, k in ((0, 0, 4), (3, 7, 5)):
        want = expected_kept(b, r, qrow, k)
        got = kept_blocks(b, table, seq, r)
        check(got == want, f"row {r}: kept blocks {got}, expected {want}")
        tail = int(b.seq[r]) - (-(-int(b.seq[r]) // BS) - 1) * BS
        check(int(seq[r]) == (k - 1) * BS + tail, f"row {r}: length {int(seq[r])}")
    out = b.run(table, seq)
    for r, qrow in ((0, 0), (3, 7)):
        ref = reference(b, r, qrow, kept_blocks(b, table, seq, r))
        err = float((out[qrow].double() - ref).abs().max())
        check(err < 2e-5, f"row {r}: kernel over the kept blocks vs fp64 reference, {err:.2e}")
        far = float((dense[qrow] - out[qrow]).abs().max())
        check(far > 1e-4, f"row {r}: pruning changed nothing ({far:.1e}): the check is void")
    for qrow in (1, 2, 3, 4, 5, 6):
        check(torch.equal(out[qrow], dense[qrow]), f"untouched token {qrow} changed")
    check(stats.layer_rows == 2 and stats.blocks_live == 10 + 9
          and stats.blocks_attended == 9, f"counters {stats}")

    # a budget covering every block: nothing moves
    full = b.plan([10, 9], writes, PruningStats())
    t2, s2, _ = prune_rows(b.q, b.kc, b.table, b.seq, b.qsl, full, bounds, layout)
    check(torch.equal(t2[:, :10], b.table[:, :10]) and torch.equal(s2, b.seq),
          "a budget covering every block changed the table")
    check(torch.equal(b.run(t2, s2), dense), "a budget covering every block changed the output")

    # rewrite a dropped block of row 0 with keys aligned to its query: after the step's writes
    # are recorded, its bound is taken again and it is kept
    dropped = [i for i in range(10) if i not in kept_blocks(b, table, seq, 0)]
    i = dropped[0]
    pos = torch.arange(i * BS, (i + 1) * BS)
    k = b.q[0].view(KVH, H // KVH, D).sum(1)[None].expand(BS, KVH, D) * 5
    b.write(0, pos, k.contiguous(), b.values[0][pos])
    b.keys[0][pos] = k
    writes.record(b.slots(0, pos), BS)
    t3, s3, _ = prune_rows(b.q, b.kc, b.table, b.seq, b.qsl, b.plan([4], writes, PruningStats()),
                           bounds, layout)
    got = kept_blocks(b, t3, s3, 0)
    check(i in got and got == expected_kept(b, 0, 0, 4), f"rewritten block {i}: kept {got}")

    # cost of one layer's selection + scheduler metadata (2 rows, ~10 blocks each)
    t0 = time.perf_counter()
    for _ in range(200):
        t4, s4, _ = prune_rows(b.q, b.kc, b.table, b.seq, b.qsl, plan, bounds, layout)
        plan.schedule(s4)
    print(f"selection per layer: {(time.perf_counter() - t0) / 200 * 1e3:.3f} ms")


def check_processor() -> None:
    p = PruningLogitsProcessor(None, torch.device("cpu"), False)
    SHARED.backend_built = True
    a = SamplingParams(extra_args={"pruning": {"min_blocks": 2}})
    plain = SamplingParams()
    outs_a: list[int] = []
    p.update_state(BatchUpdate(2, [], [(0, plain, [1], []), (1, a, [1], outs_a)], []))
    check(set(SHARED.rows) == {1}, f"rows {set(SHARED.rows)}")
    st = SHARED.rows[1]
    logits = torch.zeros(2, 16)
    logits[1, 0] = 5.0
    before = logits.clone()
    check(torch.equal(p.apply(logits), before), "the processor changed the logits")
    check(st.entropy_now() is None, "H before the token exists")
    outs_a.append(0)
    h = float(-(torch.softmax(before[1], 0) * torch.log_softmax(before[1], 0)).sum())
    check(abs(st.entropy_now() - h) < 1e-6, "H of the kept token")
    p.update_state(BatchUpdate(2, [], [], [(0, 1, MoveDirectionality.SWAP)]))
    check(SHARED.rows.get(0) is st and 1 not in SHARED.rows, "swap")
    p.update_state(BatchUpdate(2, [0], [], []))
    check(not SHARED.rows, "removal")
    p.update_state(BatchUpdate(2, [], [(1, a, [1], outs_a)], []))
    check(SHARED.rows.get(1) is st, "a request back in the batch finds its state")


def main() -> None:
    check_params()
    check_layouts()
    check_trimming()
    check_processor()
    print("ok")


if __name__ == "__main__":
    main()
