"""Block pruning on sliding-window layers, without a model: a windowed layer attends exactly
the selected positions inside its window (never the sink or another block older than the
window), a query-aware budget on a row longer than the window leaves the window dense, and
on rows that fit the window the windowed layer prunes like a full one."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from entropic import kernels
from entropic.engine.block_policy import BlockBudget
from entropic.engine.model_runner import ModelRunner
from entropic.engine.scheduler import ScheduledChunk, SchedulerOutput
from entropic.model.attention import KVCache, _decode_rows, bound_selection, window_metadata
from entropic.sampling_params import SamplingParams

HEADS, KVH, D, SCALE = 4, 1, 64, 0.125  # Gemma 3 270M's attention shape


def _runner(kernel_mode: str, num_blocks: int, bs: int, window: int,
            key_bounds: bool = False) -> ModelRunner:
    """A runner over a fake model with one windowed layer (no weights: only the runner's
    metadata and the KV cache are used)."""
    cfg = SimpleNamespace(num_layers=2, sliding_layers=(0,), num_heads=HEADS)
    model = SimpleNamespace(
        windows=[window], config=cfg, device="cpu", kernels=kernel_mode,
        make_kv_cache=lambda n, b, key_bounds=False: KVCache(1, n, b, KVH, D, torch.float32,
                                                             key_bounds=key_bounds))
    runner = ModelRunner(model, num_blocks, bs, key_bounds=key_bounds)
    g = torch.Generator().manual_seed(num_blocks * 31 + bs)
    runner.kv.kv[0, :num_blocks * bs] = torch.randn(num_blocks * bs, 2, KVH, D, generator=g)
    runner.kv.update_key_bounds(list(range(num_blocks)))
    return runner


def _decode(rid: str, table: list[int], pos: int, attend=None, budget=None) -> ScheduledChunk:
    return ScheduledChunk(rid, [1], pos, table, True, SamplingParams(max_tokens=1), 0,
                          attend_blocks=attend, attend_budget=budget)


def _reference(q: torch.Tensor, cache: torch.Tensor, rows, bs: int, window: int | None):
    """Each row's attention over its selected positions (all, if None) inside the window."""
    out = []
    for r, c in enumerate(rows):
        blocks = c.attend_blocks if c.attend_blocks is not None else range(len(c.block_table))
        lo = c.start_pos - window + 1 if window is not None else 0
        pos = [b * bs + o for b in blocks for o in range(bs)
               if lo <= b * bs + o <= c.start_pos]
        slots = [c.block_table[p // bs] * bs + p % bs for p in pos]
        k, v = cache[slots, 0].transpose(0, 1), cache[slots, 1].transpose(0, 1)
        qr = q[r].view(KVH, HEADS // KVH, D)
        out.append(F.scaled_dot_product_attention(qr, k, v, scale=SCALE).reshape(-1))
    return torch.stack(out)


def _native_ok() -> bool:
    return bool(kernels.isa_levels())


MODES = ["torch"] + (["native"] if _native_ok() else [])


@pytest.mark.parametrize("mode", MODES)
def test_windowed_layer_attends_only_selected_positions_inside_the_window(mode):
    bs, window = 4, 10
    runner = _runner(mode, 40, bs, window)
    tables = [list(range(30, 40)), [7, 3, 22, 1, 9, 14, 2, 5, 11, 6], list(range(10))]
    rows = [  # the new token at position 36 (block 9); the sink (block 0) is outside the window
        _decode("a", tables[0], 36, attend=[0, 3, 4, 8, 9]),
        _decode("b", tables[1], 36, attend=[0, 1, 2, 5, 6, 7, 8, 9]),
        _decode("c", tables[2], 36),  # dense beside them
        _decode("d", tables[2][:3], 9, attend=[0, 2]),  # the window covers its context
    ]
    _, _, _, meta, _ = runner.prepare(SchedulerOutput(1, rows))
    q = torch.randn(len(rows), HEADS, D, generator=torch.Generator().manual_seed(1))
    cache = runner.kv.kv[0]
    native = mode == "native"
    windowed = _decode_rows(q, cache, window_metadata(meta, window), SCALE, native)
    assert torch.allclose(windowed, _reference(q, cache, rows, bs, window), atol=1e-5)
    full = _decode_rows(q, cache, meta, SCALE, native)  # the full layer keeps the sink
    assert torch.allclose(full, _reference(q, cache, rows, bs, None), atol=1e-5)
    assert not torch.allclose(windowed[0], full[0], atol=1e-3)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), bs=st.sampled_from([1, 2, 4, 16]), window=st.integers(1, 70),
       mode=st.sampled_from(MODES))
def test_windowed_slots_are_the_selected_positions_inside_the_window(data, bs, window, mode):
    """The metadata itself, for random selections: a windowed layer's row gathers exactly
    the slots of its selected positions p with p > query - window, in order."""
    n = data.draw(st.integers(1, 5))
    pool = 64
    runner = _runner(mode, pool, bs, window)
    rows = []
    for i in range(n):
        pos = data.draw(st.integers(1, min(pool * bs - 1, 120)))
        nblocks = pos // bs + 1
        table = data.draw(st.permutations(range(pool)))[:nblocks]
        attend = None
        if data.draw(st.booleans()):
            attend = sorted(set(data.draw(st.lists(st.integers(0, nblocks - 1))))
                            | {nblocks - 1})
        rows.append(_decode(f"r{i}", table, pos, attend))
    _, _, _, meta, _ = runner.prepare(SchedulerOutput(1, rows))
    wmeta = window_metadata(meta, window)
    order = (meta.decode_order.tolist() if meta.decode_order is not None else list(range(n)))
    for g in wmeta.decode_groups:
        slots = g.slots.view(g.end - g.start, g.ctx)
        for k in range(g.start, g.end):
            c = rows[order[k]]
            blocks = c.attend_blocks if c.attend_blocks is not None \
                else range(c.start_pos // bs + 1)
            want = [c.block_table[p // bs] * bs + p % bs
                    for b in blocks for p in range(b * bs, (b + 1) * bs)
                    if c.start_pos - window < p <= c.start_pos]
            length = g.ctx if g.lengths is None else int(g.lengths[k - g.start])
            assert slots[k - g.start, :length].tolist() == want
            assert g.keep is None and g.mass is None


@pytest.mark.parametrize("mode", MODES)
def test_a_budget_leaves_a_window_dense_past_it_and_prunes_within_it(mode):
    """Query-aware selection: rows longer than the window attend their whole window in a
    windowed layer, exactly (the budget binds in full layers only); a group whose rows fit
    the window prunes in the windowed layer just as in a full one."""
    bs, window = 4, 16
    runner = _runner(mode, 40, bs, window, key_bounds=True)
    cache = runner.kv.kv[0]
    budget = BlockBudget(3, 1, 1)
    q = torch.randn(2, HEADS, D, generator=torch.Generator().manual_seed(2))
    native = mode == "native"
    long_rows = [_decode("a", list(range(10)), 38, budget=budget),
                 _decode("b", list(range(20, 30)), 37, budget=budget)]
    _, _, _, meta, _ = runner.prepare(SchedulerOutput(1, long_rows))
    windowed = _decode_rows(q, cache, window_metadata(meta, window), SCALE, native)
    assert torch.allclose(windowed, _reference(q, cache, long_rows, bs, window), atol=1e-5)
    full = _decode_rows(q, cache, meta, SCALE, native)
    assert not torch.allclose(full, _reference(q, cache, long_rows, bs, None), atol=1e-3)

    short_rows = [_decode("c", list(range(4)), 15, budget=budget),
                  _decode("d", list(range(30, 34)), 14, budget=budget)]
    _, _, _, meta, _ = runner.prepare(SchedulerOutput(2, short_rows))
    windowed = _decode_rows(q, cache, window_metadata(meta, window), SCALE, native)
    full = _decode_rows(q, cache, meta, SCALE, native)
    assert torch.equal(windowed, full)
    # and that is the budget's choice, not dense attention: 3 of the 4 blocks
    g = meta.decode_groups[0]
    n = g.end - g.start
    lengths = g.lengths if g.lengths is not None else torch.full((n,), g.ctx)
    qd = q if meta.decode_order is None else q.index_select(0, meta.decode_order)
    chosen = bound_selection(qd.view(n, KVH, HEADS // KVH, D), cache, g.slots.view(n, g.ctx),
                             lengths, g.keep, g.selection)
    assert chosen.sum(-1).eq(3).all()
    assert not torch.allclose(full, _reference(q, cache, short_rows, bs, None), atol=1e-3)
