import pytest
from hypothesis import given, settings, strategies as st

from entropic.engine.block_pool import BlockPool, BlockPoolError
from entropic.engine.kv_manager import KVCacheManager


def test_allocate_and_free_roundtrip():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(BlockPoolError):
        pool.allocate(2)
    assert pool.num_free == 1  # all or nothing
    pool.free(a)
    assert pool.num_free == 4


def test_double_free_and_foreign_block_rejected():
    pool = BlockPool(2)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free(a)
    with pytest.raises(BlockPoolError, match="not in this pool"):
        pool.free([7])


def test_kv_manager_grows_table_on_demand():
    kv = KVCacheManager(BlockPool(10), block_size=4)
    assert kv.allocate("r", 5)
    assert kv.num_blocks_held("r") == 2
    assert kv.allocate("r", 8)
    assert kv.num_blocks_held("r") == 2
    assert kv.allocate("r", 9)
    assert kv.num_blocks_held("r") == 3
    assert not kv.allocate("s", 100)  # no partial allocation, no table left behind
    assert kv.pool.num_free == 7 and kv.num_tracked == 1
    kv.free("r")
    assert kv.pool.num_free == 10 and kv.num_tracked == 0


ops = st.lists(st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5),
                         st.integers(1, 40)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_operations_never_leak_or_share_blocks(seq):
    pool = BlockPool(12)
    kv = KVCacheManager(pool, block_size=4)
    sizes: dict[str, int] = {}
    for op, who, n in seq:
        rid = f"r{who}"
        if op == "grow":
            target = max(n, sizes.get(rid, 0))
            if kv.allocate(rid, target):
                sizes[rid] = target
        else:
            kv.free(rid)
            sizes.pop(rid, None)
        held = [b for r in sizes for b in kv.block_table(r)]
        assert len(held) == len(set(held)), "a block is owned twice"
        assert len(held) + pool.num_free == pool.num_blocks, "a block leaked"
        for r, s in sizes.items():
            assert kv.num_blocks_held(r) == -(-s // 4)
    for r in list(sizes):
        kv.free(r)
    assert pool.num_free == pool.num_blocks
