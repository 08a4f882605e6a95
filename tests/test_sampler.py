"""Sampler checks on tiny distributions against known values."""
import math

import pytest
import torch

from entropic.sampling.sampler import Sampler, SamplingBatch, entropy_from_logits
from entropic.sampling_params import SamplingParams

P4 = torch.tensor([0.5, 0.3, 0.15, 0.05])


def batch(params, n=None):
    n = n or len(params)
    return SamplingBatch([f"r{i}" for i in range(n)], list(params), [0] * n)


def frequencies(params, logits, n=40_000):
    s = Sampler()
    out = s(logits.expand(n, -1).clone(), batch([params] * n))
    return torch.bincount(out.token_ids, minlength=logits.shape[-1]).float() / n


def test_entropy_exact_on_known_distributions():
    logits = torch.stack([torch.zeros(4), torch.tensor([0.0, -math.inf, -math.inf, -math.inf]),
                          P4.log()])
    h = entropy_from_logits(logits)
    expected = -(P4 * P4.log()).sum()
    assert torch.allclose(h, torch.tensor([math.log(4), 0.0, expected]), atol=1e-6)
    out = Sampler()(logits, batch([SamplingParams(temperature=0)] * 3))
    assert torch.allclose(out.entropies, h, atol=1e-6)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 0.0]])
    out = Sampler()(logits, batch([SamplingParams(temperature=0)] * 2))
    assert out.token_ids.tolist() == [1, 0]


def test_underflowing_temperature_samples_greedily():
    """logits / 1e-39 overflows fp32 (NaN probabilities, token 0 every time): such
    temperatures take the greedy path and report temperature 0."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 6.0]])
    for t in (1e-39, 1e-45, 5e-6):
        out = Sampler()(logits.clone(), batch([SamplingParams(temperature=t, seed=3)] * 2))
        assert out.token_ids.tolist() == [1, 3] and out.temperatures.tolist() == [0.0, 0.0]


def test_temperature_matches_tempered_softmax():
    T = 0.5
    f = frequencies(SamplingParams(temperature=T), P4.log())
    expected = torch.softmax(P4.log() / T, -1)
    assert torch.allclose(f, expected, atol=0.012)


def test_top_k_top_p_min_p_known_supports():
    # top-k 2 keeps {0, 1}; renormalised 0.5/0.8, 0.3/0.8
    f = frequencies(SamplingParams(temperature=1, top_k=2), P4.log())
    assert torch.allclose(f, torch.tensor([0.625, 0.375, 0, 0]), atol=0.012)
    # top-p 0.7: mass before token 2 is 0.8 >= 0.7, so {0, 1} are kept
    f = frequencies(SamplingParams(temperature=1, top_p=0.7), P4.log())
    assert torch.allclose(f, torch.tensor([0.625, 0.375, 0, 0]), atol=0.012)
    # top-p 0.85 keeps {0, 1, 2}
    f = frequencies(SamplingParams(temperature=1, top_p=0.85), P4.log())
    assert torch.allclose(f, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=0.012)
    # min-p 0.5: keep p >= 0.25
    f = frequencies(SamplingParams(temperature=1, min_p=0.5), P4.log())
    assert torch.allclose(f, torch.tensor([0.625, 0.375, 0, 0]), atol=0.012)
    # top-k 1 is greedy
    f = frequencies(SamplingParams(temperature=2, top_k=1), P4.log(), n=200)
    assert f.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_rows_use_their_own_params():
    logits = torch.stack([P4.log()] * 3)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1, top_k=1),
              SamplingParams(temperature=1, min_p=0.9)]
    for _ in range(20):
        assert Sampler()(logits.clone(), batch(params)).token_ids.tolist() == [0, 0, 0]


def test_seeded_rows_reproducible_whatever_the_batch():
    logits = torch.randn(1, 1000)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draws(other_rows):
        s = Sampler()
        seq = []
        for step in range(10):
            params = [SamplingParams(temperature=1.0)] * other_rows + [seeded]
            b = SamplingBatch([f"o{i}" for i in range(other_rows)] + ["me"], params,
                              [0] * other_rows + [step])
            x = torch.cat([torch.randn(other_rows, 1000), logits])
            seq.append(s(x, b).token_ids[-1].item())
        return seq

    assert draws(0) == draws(5) == draws(17)
    assert len(set(draws(0))) > 1  # it does sample


def test_seeded_draw_depends_on_seed_and_position_only():
    """Output position i of a seeded request draws the same token whenever it is sampled:
    alone, after other positions, or beside its neighbours in one call (a verify)."""
    logits = torch.randn(6, 1000)
    p = SamplingParams(temperature=1.0, seed=99)
    one_by_one = [Sampler()(logits[i:i + 1], SamplingBatch(["me"], [p], [i])).token_ids.item()
                  for i in range(6)]
    together = Sampler()(logits, SamplingBatch(["me"] * 6, [p] * 6, list(range(6))))
    assert together.token_ids.tolist() == one_by_one
    reversed_ = [Sampler()(logits[i:i + 1], SamplingBatch(["me"], [p], [i])).token_ids.item()
                 for i in reversed(range(6))]
    assert reversed_[::-1] == one_by_one


def test_logprobs_and_top_alternatives():
    logits = torch.stack([P4.log(), P4.flip(0).log()])
    out = Sampler()(logits, batch([SamplingParams(temperature=0, logprobs=2)] * 2))
    assert torch.allclose(out.logprobs, P4.log()[[0, 0]].float(), atol=1e-6)
    assert out.top_ids.tolist() == [[0, 1], [3, 2]]
    assert torch.allclose(out.top_logprobs[0], P4.log()[:2], atol=1e-6)


def test_nan_logits_raise_clear_error():
    logits = torch.tensor([[0.0, float("nan"), 1.0, 2.0]])
    with pytest.raises(FloatingPointError, match="NaN"):
        Sampler()(logits, batch([SamplingParams()]))


def test_neg_inf_entries_never_sampled():
    logits = torch.tensor([[0.0, -math.inf, 0.0, -math.inf]]).expand(5000, -1).clone()
    out = Sampler()(logits, batch([SamplingParams(temperature=1.5)] * 5000))
    assert set(out.token_ids.tolist()) <= {0, 2}


@pytest.mark.parametrize("native", [False, True])
def test_tempered_entropy_per_row(native):
    """H^T of each row at its own temperature, before truncation: H at T = 1, 0 for greedy,
    measured where the row asks, NaN (not measured) where a pass would be needed and the
    row does not ask."""
    if native:
        from entropic import kernels
        kernels.load()
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 300, generator=g) * 2
    params = [SamplingParams(temperature=1.0),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0.5, tempered_entropy=True),
              SamplingParams(temperature=0.5),
              SamplingParams(temperature=2.0, top_k=3, top_p=0.5, tempered_entropy=True)]
    out = Sampler(native=native)(logits.clone(), batch(params))
    h = out.tempered_entropies
    assert h[0].item() == out.entropies[0].item()
    assert h[1].item() == 0.0
    assert h[2].item() == pytest.approx(entropy_from_logits(logits[2:3] / 0.5).item(), abs=1e-5)
    assert math.isnan(h[3].item())
    # the truncation by top-k / top-p comes after: H^T is of the whole tempered distribution
    assert h[4].item() == pytest.approx(entropy_from_logits(logits[4:5] / 2.0).item(), abs=1e-5)
    assert h[4].item() > math.log(3)


def test_tempered_entropy_flag_is_checked():
    with pytest.raises(TypeError, match="tempered_entropy must be a bool"):
        SamplingParams(tempered_entropy=1)
