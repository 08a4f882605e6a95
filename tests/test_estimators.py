import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from entropic.control.estimators import (ExactEntropy, TopKEntropy, TopKTailEntropy,
                                         floor_entropy, make_estimator)


def test_exact_on_known_distributions():
    p = torch.tensor([[0.5, 0.25, 0.25, 0.0]])
    h = ExactEntropy()(p.log())
    assert h.item() == pytest.approx(1.5 * math.log(2), abs=1e-6)
    assert ExactEntropy()(torch.zeros(2, 10)).tolist() == pytest.approx([math.log(10)] * 2)


def test_topk_and_tail_values_by_hand():
    p = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1])
    top2 = TopKEntropy(2)(p.log()[None]).item()
    assert top2 == pytest.approx(-(0.4 * math.log(0.4) + 0.3 * math.log(0.3)), abs=1e-6)
    tail = TopKTailEntropy(2)(p.log()[None]).item()
    assert tail == pytest.approx(top2 - 0.3 * math.log(0.3 / 3), abs=1e-6)
    # tail mass spread uniformly here, so the correction is exact
    assert tail == pytest.approx(ExactEntropy()(p.log()[None]).item(), abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 60), st.floats(0.1, 8.0), st.integers(0, 2**31 - 1))
def test_bounds_topk_below_exact_below_tail(k, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 64, generator=g) * scale
    exact = ExactEntropy()(logits)
    tol = 1e-4  # float32: the tail mass 1 - sum(top p) carries ~1e-6 absolute error
    assert (TopKEntropy(k)(logits) <= exact + tol).all()
    assert (TopKTailEntropy(k)(logits) >= exact - tol).all()


def test_k_at_least_vocab_is_exact():
    logits = torch.randn(3, 16)
    assert torch.allclose(TopKTailEntropy(16)(logits), ExactEntropy()(logits), atol=1e-6)
    assert torch.allclose(TopKEntropy(99)(logits), ExactEntropy()(logits), atol=1e-6)


def test_factory_and_floor():
    assert make_estimator("top32+tail").name == "top32+tail"
    assert make_estimator("top8").k == 8
    with pytest.raises(ValueError, match="estimator"):
        make_estimator("topx")
    h = torch.tensor([0.0, 0.5, 2.0])
    assert floor_entropy(h, 0.3).tolist() == pytest.approx([0.3, 0.5, 2.0])
