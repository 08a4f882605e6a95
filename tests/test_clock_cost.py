import pytest

from entropic.config import ModelConfig
from entropic.control.clock import EntropicClock, entropic_time
from entropic.engine.cost import Cost, CostModel, dense_work

CFG = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=4, max_position=64)


def test_entropic_time_counts_only_drops():
    assert entropic_time([3.0, 1.0, 2.0, 0.5, 0.5]) == pytest.approx(2.0 + 1.5)
    assert entropic_time([1.0]) == 0.0 and entropic_time([]) == 0.0
    assert entropic_time([0.1, 0.2, 0.3]) == 0.0  # rising entropy never advances tau


def test_clock_per_request_and_engine_wide():
    clock = EntropicClock(window=3)
    for h in [3.0, 1.0, 2.0, 0.5]:
        clock.observe("a", h)
    for h in [1.0, 0.0]:
        clock.observe("b", h)
    assert clock.history("a") == [1.0, 2.0, 0.5]
    r = clock.reading("a", Cost(flops_linear=2e12, seconds=0.5))
    assert r.tau == pytest.approx(3.5) and r.mean_entropy == pytest.approx(1.625)
    assert r.tau_per_tflop == pytest.approx(1.75) and r.tau_per_second == pytest.approx(7.0)
    assert clock.tau_total == pytest.approx(4.5)
    clock.release(["a"])
    assert clock.reading("a", Cost()) is None and clock.tau_total == pytest.approx(4.5)


def test_cost_model_counts_by_hand():
    m = CostModel(CFG, kv_element_bytes=2)
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16  # qkv, o, gate/up/down
    assert m.linear_per_token == 2 * 2 * per_layer
    # a prefill chunk of 3 tokens after 2 cached: attends 3+4+5 = 12 pairs, reads 5 positions
    w = dense_work("r", start=2, num_tokens=3, sampled=True)
    assert (w.attended_pairs, w.kv_positions_read) == (12, 5)
    c = m.chunk_cost(w)
    assert c.flops_linear == 3 * m.linear_per_token + 2 * 100 * 8
    assert c.flops_attention == 12 * 4 * 2 * 2 * 4
    assert c.kv_bytes_read == 5 * 2 * 2 * 4 * 2
    costs = m.step_costs([w, dense_work("s", 9, 1, True)], seconds=1.0)
    assert sum(x.seconds for x in costs.values()) == pytest.approx(1.0)
    assert costs["r"].seconds > costs["s"].seconds


def test_clock_fits_drop_per_nat():
    clock = EntropicClock()
    assert clock.drop_per_nat(default=0.7) == 0.7 and clock.mean_entropy is None
    for h in [2.0, 1.0, 3.0, 1.5]:  # drops 1.0 after H=2, 0 after 1, 1.5 after 3
        clock.observe("a", h)
    assert clock.drop_per_nat() == pytest.approx((2 * 1.0 + 1 * 0 + 3 * 1.5) / (4 + 1 + 9))
    assert clock.mean_entropy == pytest.approx(1.875)
