"""The thermostat as a transformers LogitsProcessor, against the engine's own thermostat."""
import pytest
import torch

from entropic.control.thermostat import next_temperature
from entropic.integrations.transformers import ThermostatLogitsProcessor
from entropic.sampling.sampler import entropy_from_logits
from entropic.sampling_params import SamplingParams, ThermostatParams

PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.mark.model
@pytest.mark.parametrize("mode", ["stabilize", "follow"])
def test_temperatures_match_the_engine_on_its_tokens(llm_fp32, hf_reference, mode):
    """The engine samples with its thermostat; transformers' model, fed the same tokens
    (teacher forcing), drives the processor: the temperature at every step is the engine's,
    up to the fp32 difference between the two forward passes."""
    th = ThermostatParams(target_entropy=2.0, eta=0.3, t_min=0.3, t_max=2.5, mode=mode)
    out = llm_fp32.chat(PROMPT, SamplingParams(max_tokens=16, temperature=1.3, seed=11,
                                               ignore_eos=True, thermostat=th))[0]
    assert len(out.temperatures) == 16
    assert len(set(round(t, 3) for t in out.temperatures)) > 5  # the law actually moved T
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    n = len(out.prompt_token_ids)
    with torch.inference_mode():
        logits = hf_reference(ids).logits[0, n - 1:-1].float()  # the row behind each token
    proc = ThermostatLogitsProcessor(th, temperature=1.3)
    for t in range(16):
        proc(ids[:, :n + t], logits[t:t + 1].clone())
    temps, _ = proc.trace()
    torch.testing.assert_close(temps[0], torch.tensor(out.temperatures), rtol=2e-4, atol=0)


@pytest.mark.model
def test_generate_samples_at_the_processor_temperatures(hf_reference, llm_fp32):
    """Inside generate(): every step's processed scores are the raw logits over the row's
    T_t (no other warper: temperature 1, top-k 0, top-p 1), and T_t follows the law from the
    entropy of those very scores."""
    ids = torch.tensor([llm_fp32.tokenizer.apply_chat_template(PROMPT)])
    th = ThermostatParams(target_entropy=1.5, eta=0.5, t_min=0.4, t_max=2.0)
    proc = ThermostatLogitsProcessor(th, temperature=1.0)
    torch.manual_seed(0)
    with torch.inference_mode():
        res = hf_reference.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                    max_new_tokens=6, num_return_sequences=2,
                                    logits_processor=[proc], return_dict_in_generate=True,
                                    output_scores=True, output_logits=True,
                                    pad_token_id=hf_reference.config.eos_token_id)
    temps, ents = proc.trace()
    n = len(res.scores)  # 6 unless both rows ended early
    assert temps.shape == (2, n) and n >= 3
    for s in range(n):
        raw, scored = res.logits[s].float(), res.scores[s].float()
        torch.testing.assert_close(scored, raw / temps[:, s:s + 1], rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(ents[:, s], entropy_from_logits(scored))
        if s:
            want = [next_temperature(float(t), float(h), 1.5, 0.5, 0.4, 2.0, "stabilize")
                    for t, h in zip(temps[:, s - 1], ents[:, s - 1])]
            torch.testing.assert_close(temps[:, s], torch.tensor(want))
    assert bool(((temps >= 0.4) & (temps <= 2.0)).all())
    assert temps[:, 1:].ne(1.0).any()  # the law moved T inside generate()


def _stream(steps, rows, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.5, 4.0, rows)[:, None]
    return [torch.randn(rows, vocab, generator=g) * scale for _ in range(steps)]


def test_rows_keep_their_state_when_reordered():
    """Beam search reorders and duplicates rows: each row keeps the temperature of the row
    it extends, exactly as if nothing had moved."""
    th = ThermostatParams(target_entropy=2.5, eta=0.4, t_min=0.2, t_max=3.0)
    steps = _stream(6, 3)
    base = ThermostatLogitsProcessor(th)
    ids = torch.tensor([[5, 6], [7, 8], [9, 10]])
    for s, sc in enumerate(steps):
        base(ids, sc)
        ids = torch.cat([ids, torch.tensor([[s], [s + 1], [s + 2]])], 1)
    want, _ = base.trace()

    moved = ThermostatLogitsProcessor(th)
    ids = torch.tensor([[5, 6], [7, 8], [9, 10]])
    order = torch.arange(3)  # which original row each current row is
    for s, sc in enumerate(steps):
        if s == 3:  # a reorder that also duplicates row 2 and drops row 0
            perm = torch.tensor([2, 1, 2])
            ids, order = ids[perm], order[perm]
        moved(ids, sc[order])
        ids = torch.cat([ids, torch.tensor([[s], [s + 1], [s + 2]])[order]], 1)
    got, _ = moved.trace()
    torch.testing.assert_close(got, want[order])
    assert not torch.equal(got, want)  # the reorder did change which row holds which state


def test_a_new_generation_starts_from_t0_and_a_half_match_is_an_error():
    th = ThermostatParams(target_entropy=0.5, eta=1.0, t_min=0.2, t_max=3.0)
    proc = ThermostatLogitsProcessor(th, temperature=1.0)
    sc = torch.zeros(2, 32)  # uniform: log 32 > target, T falls
    proc(torch.tensor([[1, 2], [3, 4]]), sc)
    proc(torch.tensor([[1, 2, 0], [3, 4, 0]]), sc)
    assert proc.trace()[0][0].tolist()[1] < 1.0
    proc(torch.tensor([[9, 9, 9, 9, 9]] * 2), sc)  # different prompt: a new generation
    assert proc.trace()[0].tolist() == [[1.0], [1.0]]
    with pytest.raises(ValueError, match="extend no row"):
        proc(torch.tensor([[9, 9, 9, 9, 9, 1], [8, 9, 9, 9, 9, 1]]), sc)


def test_the_step_is_the_engine_law():
    th = ThermostatParams(target_entropy=1.0, eta=0.7, t_min=0.3, t_max=2.0, h_min=0.2)
    proc = ThermostatLogitsProcessor(th, temperature=5.0)  # T_0 clipped to t_max
    sc = _stream(1, 2)[0]
    out = proc(torch.tensor([[1], [2]]), sc.clone())
    torch.testing.assert_close(out, sc / 2.0)
    h = entropy_from_logits(sc / 2.0).clamp_min(0.2)
    proc(torch.tensor([[1, 1], [2, 2]]), sc.clone())
    temps, ents = proc.trace()
    torch.testing.assert_close(ents[:, 0], h)
    assert temps[:, 1].tolist() == pytest.approx(
        [next_temperature(2.0, float(x), 1.0, 0.7, 0.3, 2.0, "stabilize") for x in h])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="temperature > 0"):
        ThermostatLogitsProcessor(ThermostatParams(), temperature=0.0)
    with pytest.raises(ValueError, match="temperature must be in"):
        ThermostatLogitsProcessor(ThermostatParams(), temperature=-1.0)
    proc = ThermostatLogitsProcessor(ThermostatParams())
    with pytest.raises(ValueError, match="rows of ids"):
        proc(torch.tensor([[1], [2]]), torch.zeros(3, 8))
