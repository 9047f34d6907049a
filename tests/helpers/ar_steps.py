"""Driving an AR engine through waves of requests and comparing two runs step by step: the
CUDA-graph tests (tests/golden/ar/test_cuda_graphs.py, test_prefill_graphs.py) run the same
waves on an engine with graphs and on an eager one."""

from __future__ import annotations

import torch

from omnistage.ar.engine import AREngine


def drive(engine: AREngine, waves: list[list[tuple]], steps_between: int = 3
          ) -> dict[str, list]:
    """Add each wave of requests (id, prompt token ids or prompt embeddings (n, hidden),
    params), step a few times, the next wave... then to the end.
    -> request id -> [(token ids, logprobs, hidden states)] per step output."""
    got: dict[str, list] = {}

    def step() -> None:
        for o in engine.step():
            got.setdefault(o.request_id, []).append((o.new_token_ids, o.logprobs,
                                                     o.hidden_states))

    for wave in waves:
        for rid, prompt, params in wave:
            if isinstance(prompt, torch.Tensor):
                engine.add_request(rid, None, params, prompt_embeds=prompt)
            else:
                engine.add_request(rid, prompt, params)
        for _ in range(steps_between):
            step()
    while engine.has_unfinished_requests:
        step()
    return got


def assert_same(got: dict[str, list], want: dict[str, list],
                same_hidden_steps: bool = False) -> None:
    """The same tokens at every step, logprobs within 1e-5, hidden states within 1e-5;
    same_hidden_steps: also hidden states at the same steps (none where the other has none)."""
    assert set(got) == set(want)
    for rid in want:
        assert [g[0] for g in got[rid]] == [w[0] for w in want[rid]], rid
        for (_, lp, hidden), (_, ref_lp, ref_hidden) in zip(got[rid], want[rid]):
            for tok, value in (lp[0] if lp else {}).items():
                assert abs(value - ref_lp[0][tok]) < 1e-5, (rid, tok)
            if same_hidden_steps:
                assert (hidden is None) == (ref_hidden is None), rid
            for layer, h in (hidden or {}).items():
                torch.testing.assert_close(h, ref_hidden[layer], atol=1e-5, rtol=1e-5)
