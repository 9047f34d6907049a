"""CPU tests of the sampler: greedy, top-k/top-p/min-p, penalties, min_tokens, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from omnistage.ar.sampler import Sampler, apply_penalties
from omnistage.ar.sequence import Sequence
from omnistage.sampling_params import SamplingParams

EOS = 3


def make_seq(prompt: list[int] | None = None, output: list[int] | None = None,
             request_id: str = "r", **params: object) -> Sequence:
    seq = Sequence(request_id, list(prompt or [5]), SamplingParams(**params))
    seq.output_token_ids = list(output or [])
    return seq


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def draw_many(logits: torch.Tensor, n: int, **params: object) -> list[int]:
    """n unseeded draws from one (1, V) distribution, as one batch of n identical rows."""
    seqs = [make_seq(**params) for _ in range(n)]
    return Sampler(seed=0)(logits.expand(n, -1), seqs, (EOS,)).token_ids


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    seqs = [make_seq(temperature=0.0) for _ in range(8)]
    out = Sampler()(logits, seqs, (EOS,))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8
    assert all(s.generator is None for s in seqs)


def test_greedy_row_consumes_no_randomness() -> None:
    logits = torch.zeros(1, 32)
    a, b = Sampler(seed=7), Sampler(seed=7)
    a(logits, [make_seq(temperature=0.0)], (EOS,))
    assert a(logits, [make_seq()], (EOS,)).token_ids == b(logits, [make_seq()], (EOS,)).token_ids


def test_bf16_logits() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0]], dtype=torch.bfloat16)
    assert Sampler()(logits, [make_seq(temperature=0.0)], (EOS,)).token_ids == [1]


def test_top_k_never_samples_outside_top_k() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 40)
    allowed = set(logits[0].topk(3).indices.tolist())
    drawn = draw_many(logits, 2000, top_k=3)
    assert set(drawn) == allowed


def test_top_p_with_peaked_distribution_keeps_only_top_token() -> None:
    logits = probs_logits([0.01, 0.95, 0.02, 0.02])
    assert set(draw_many(logits, 1000, top_p=0.9)) == {1}


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = probs_logits([0.2, 0.5, 0.1, 0.2])
    # Sorted: 0.5 (1), then 0.2 (0, first by stable sort), 0.2 (3), 0.1 (2).
    assert set(draw_many(logits, 2000, top_p=0.65)) == {0, 1}
    assert set(draw_many(logits, 2000, top_p=0.75)) == {0, 1, 3}


def test_top_k_and_top_p_combined() -> None:
    logits = probs_logits([0.4, 0.3, 0.2, 0.1])
    # top-k 2 renormalises to (4/7, 3/7); top-p 0.5 then keeps token 0 only.
    assert set(draw_many(logits, 1000, top_k=2, top_p=0.5)) == {0}


def test_min_p_drops_unlikely_tokens() -> None:
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    # threshold = 0.2 * 0.5 = 0.1: token 3 (0.05) goes, token 2 (0.15) stays.
    assert set(draw_many(logits, 2000, min_p=0.2)) == {0, 1, 2}


def test_sampling_frequencies_follow_probs() -> None:
    logits = probs_logits([0.1, 0.6, 0.3])
    drawn = torch.tensor(draw_many(logits, 20000))
    freqs = torch.bincount(drawn, minlength=3).float() / len(drawn)
    assert torch.allclose(freqs, torch.tensor([0.1, 0.6, 0.3]), atol=0.02), freqs


def test_near_zero_temperature_is_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(16, 100)
    seqs = [make_seq(temperature=1e-3) for _ in range(16)]
    assert Sampler()(logits, seqs, (EOS,)).token_ids == logits.argmax(dim=-1).tolist()


def test_nan_and_masked_logits_are_never_sampled() -> None:
    logits = torch.tensor([[float("nan"), 1.0, float("-inf"), 0.5]])
    assert Sampler()(logits, [make_seq(temperature=0.0)], (EOS,)).token_ids == [1]
    assert set(draw_many(logits, 500)) == {1, 3}


def test_penalties_exact_values() -> None:
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 3.0]])
    seq = make_seq(prompt=[1], output=[0, 0, 2], repetition_penalty=2.0,
                   frequency_penalty=0.5, presence_penalty=0.25)
    x = logits.clone()
    apply_penalties(x, [seq])
    # token 0: 2/2 - 0.5*2 - 0.25 ; token 1 (prompt only): 1/2 ; token 2: -1*2 - 0.5 - 0.25
    expected = torch.tensor([[-0.25, 0.5, -2.75, 0.5, 3.0]])
    assert torch.equal(x, expected), x


def test_penalties_only_touch_rows_that_ask() -> None:
    logits = torch.tensor([[2.0, 1.0], [2.0, 1.0]])
    seqs = [make_seq(output=[0], repetition_penalty=4.0), make_seq(output=[0])]
    x = logits.clone()
    apply_penalties(x, seqs)
    assert x.tolist() == [[0.5, 1.0], [2.0, 1.0]]


@pytest.mark.parametrize("params", [
    {"repetition_penalty": 2.0},      # 2.0 -> 1.0 < 1.5
    {"frequency_penalty": 0.3},       # 2.0 - 0.3 * 2 = 1.4 < 1.5
    {"presence_penalty": 0.6},        # 2.0 - 0.6 = 1.4 < 1.5
])
def test_penalty_flips_greedy(params: dict[str, float]) -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    plain = make_seq(output=[0, 0], temperature=0.0)
    penalised = make_seq(output=[0, 0], temperature=0.0, **params)
    assert Sampler()(logits, [plain], (EOS,)).token_ids == [0]
    assert Sampler()(logits, [penalised], (EOS,)).token_ids == [1]


def test_repetition_penalty_applies_to_prompt_tokens() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    seq = make_seq(prompt=[0], temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(logits, [seq], (EOS,)).token_ids == [1]
    # presence/frequency ignore the prompt
    seq = make_seq(prompt=[0], temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert Sampler()(logits, [seq], (EOS,)).token_ids == [0]


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0, 0.0, 7.0]])  # EOS=3 best, stop id 5 next
    params = {"temperature": 0.0, "min_tokens": 2, "stop_token_ids": (5,)}
    sampler = Sampler()
    assert sampler(logits, [make_seq(output=[1], **params)], (EOS,)).token_ids == [2]
    assert sampler(logits, [make_seq(output=[1, 1], **params)], (EOS,)).token_ids == [EOS]
    # the sequence's own eos ids count too
    seq = make_seq(output=[], **params)
    seq.eos_token_ids = (2,)
    assert sampler(logits, [seq], (EOS,)).token_ids == [1]


def fake_logits(seq: Sequence, vocab_size: int = 64) -> torch.Tensor:
    """Logits that depend only on the sequence's own history, like a real model's."""
    history = seq.output_token_ids
    gen = torch.Generator().manual_seed(1000 + 31 * len(history) + sum(history))
    return torch.randn(vocab_size, generator=gen)


def run_steps(sampler: Sampler, seqs: list[Sequence], num_steps: int) -> None:
    for _ in range(num_steps):
        logits = torch.stack([fake_logits(s) for s in seqs])
        for seq, tok in zip(seqs, sampler(logits, seqs, (EOS,)).token_ids):
            seq.output_token_ids.append(tok)


def test_seeded_request_is_batch_invariant() -> None:
    alone = make_seq(seed=1234, temperature=1.0)
    run_steps(Sampler(seed=0), [alone], 12)

    others: list[Sequence] = []
    for j in range(15):
        kinds = [{"seed": 77 + j}, {}, {"temperature": 0.0}, {"top_k": 5, "seed": 9},
                 {"top_p": 0.8}]
        others.append(make_seq(request_id=f"o{j}", **kinds[j % len(kinds)]))
    batched = make_seq(seed=1234, temperature=1.0)
    batch = others[:7] + [batched] + others[7:]
    assert len(batch) == 16
    run_steps(Sampler(seed=99), batch, 12)
    assert batched.output_token_ids == alone.output_token_ids
    assert len(set(alone.output_token_ids)) > 3  # actually random, not stuck on one token


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    def tokens(seed: int) -> list[int]:
        seq = make_seq(seed=seed)
        run_steps(Sampler(), [seq], 12)
        return seq.output_token_ids

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)


def test_unseeded_rows_follow_engine_seed() -> None:
    logits = torch.zeros(4, 1000)
    def draw(seed: int) -> list[int]:
        return Sampler(seed)(logits, [make_seq() for _ in range(4)], (EOS,)).token_ids
    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_logprobs_top_n_sorted_with_sampled_token() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, 30)
    seqs = [make_seq(logprobs=3), make_seq(), make_seq(logprobs=0, temperature=0.0)]
    out = Sampler()(logits, seqs, (EOS,))
    expected = torch.log_softmax(logits, dim=-1)

    lp = out.logprobs[0]
    assert lp is not None
    top3 = expected[0].topk(3).indices.tolist()
    assert list(lp)[:3] == top3
    assert out.token_ids[0] in lp and len(lp) == (3 if out.token_ids[0] in top3 else 4)
    for tok, val in lp.items():
        assert math.isclose(val, expected[0, tok].item(), rel_tol=0, abs_tol=1e-6)
    vals = [lp[t] for t in top3]
    assert vals == sorted(vals, reverse=True)

    assert out.logprobs[1] is None
    assert out.logprobs[2] == {out.token_ids[2]: pytest.approx(expected[2].max().item(), abs=1e-6)}


def test_logprobs_are_raw_before_penalties() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    seq = make_seq(output=[0], temperature=0.0, repetition_penalty=2.0, logprobs=1)
    out = Sampler()(logits, [seq], (EOS,))
    raw = torch.log_softmax(logits[0], dim=-1).tolist()
    assert out.token_ids == [1]
    assert out.logprobs[0] == {0: pytest.approx(raw[0]), 1: pytest.approx(raw[1])}
    assert list(out.logprobs[0]) == [0, 1]


def test_inplace_equals_copy_and_keeps_raw_logprobs() -> None:
    """The runner lets the sampler work on its logits in place: the same tokens and logprobs
    as on a copy, with penalties, min_tokens, sampling and raw logprobs in one batch."""
    torch.manual_seed(3)
    logits = torch.randn(4, 40)

    def batch() -> list[Sequence]:
        return [make_seq([1, 2], [7], temperature=0.0, repetition_penalty=1.5, logprobs=3),
                make_seq(temperature=0.8, seed=11, min_tokens=5, logprobs=2),
                make_seq(temperature=0.0),
                make_seq([4], [9, 9], temperature=1.0, seed=5, frequency_penalty=0.5)]

    expected = Sampler(seed=1)(logits, batch(), (EOS,))
    mine = logits.clone()
    got = Sampler(seed=1)(mine, batch(), (EOS,), inplace=True)
    assert got.token_ids == expected.token_ids
    assert got.logprobs == expected.logprobs
    raw = torch.log_softmax(logits[0], dim=-1)               # logprobs are of the raw logits
    tok = got.token_ids[0]
    assert got.logprobs[0][tok] == pytest.approx(raw[tok].item(), abs=1e-5)
    assert not torch.equal(mine, logits)                     # worked in place (penalised)


def test_pending_tokens_count_as_outputs() -> None:
    """Async scheduling samples a step before the host has the last token: passed as
    `pending`, it counts for the penalties and min_tokens exactly as if it were appended
    (logits and logprobs the same), and nothing else changes."""
    torch.manual_seed(0)
    vocab = 12
    logits = torch.randn(4, vocab) * 2
    params = [dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4,
                   logprobs=3, temperature=0.0),
              dict(min_tokens=3, logprobs=3, temperature=0.0),   # 2 outputs + pending: 3
              dict(min_tokens=4, logprobs=3, temperature=0.0),   # still short: EOS banned
              dict(logprobs=3, temperature=0.8)]
    outputs = [[3, 3, 7], [1, 2], [1, 2], [4]]
    pending = [7, 9, 5, 4]
    logits[1, EOS] = logits[2, EOS] = 50.0                  # EOS wins unless banned
    logits[0] = -5.0
    logits[0, 7], logits[0, 8] = 5.0, 2.0   # 7 wins after one 7 (2.23), not after two (1.53)

    def seqs(with_pending: bool) -> list[Sequence]:
        return [make_seq(output=o + ([t] if with_pending else []), request_id=str(i), **p)
                for i, (o, t, p) in enumerate(zip(outputs, pending, params))]

    want = Sampler(seed=1)(logits.clone(), seqs(True), (EOS,))   # the same draws each
    before = seqs(False)
    sampler = Sampler(seed=1)
    got = sampler.to_host(sampler.sample(logits.clone(), before, (EOS,),
                                         pending=torch.tensor(pending)), before)
    assert got.token_ids == want.token_ids
    assert got.token_ids[0] == 8 and got.token_ids[1] == EOS and got.token_ids[2] != EOS
    for g, w in zip(got.logprobs, want.logprobs):
        assert g.keys() == w.keys() and all(abs(g[k] - w[k]) < 1e-6 for k in g)
    assert [s.output_token_ids for s in before] == outputs        # the host lists untouched
