"""Engine-level golden tests: our continuous batching vs transformers' generate, prompt by prompt."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig
from omnistage.outputs import OmniOutput
from omnistage.sampling_params import SamplingParams

PROMPT_LENS = [1, 3, 17, 40, 64, 99, 150, 200]
MAX_TOKENS = 12


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(64)]
    prompts = []
    for n in PROMPT_LENS:
        if n >= 64 and n != 99:  # several prompts share a 64-token prefix: prefix hits happen
            prompts.append(shared + [rng.randrange(vocab) for _ in range(n - 64)])
        else:
            prompts.append([rng.randrange(vocab) for _ in range(n)])
    return prompts


_REF_CACHE: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def reference(path: Path, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    key = (str(path), tuple(prompt))
    if key not in _REF_CACHE:
        model = _hf_model(path)
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, pad_token_id=0)
        _REF_CACHE[key] = out[0, len(prompt):].tolist()
    return _REF_CACHE[key]


_HF: dict[str, torch.nn.Module] = {}


def _hf_model(path: Path) -> torch.nn.Module:
    if str(path) not in _HF:
        _HF[str(path)] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF[str(path)]


def make_engine(path: Path, max_num_batched_tokens: int = 2048, num_kv_blocks: int | None = None,
                enable_prefix_caching: bool = True, block_size: int = 16) -> AREngine:
    return AREngine(ARConfig(
        model=str(path), device="cpu",
        kv_cache=KVCacheConfig(block_size=block_size, num_blocks=num_kv_blocks,
                               enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens)))


def generate(engine: AREngine, prompts: list[list[int] | dict], params: SamplingParams
             ) -> list[OmniOutput]:
    """Submit every prompt at once and step until all finish (continuous batching)."""
    outs = {}
    for i, p in enumerate(prompts):
        rid = f"g{generate.counter}-{i}"
        if isinstance(p, dict):
            engine.add_request(rid, None, params, prompt_embeds=p["prompt_embeds"])
        else:
            engine.add_request(rid, p, params)
        outs[rid] = OmniOutput(rid, None, [])
    generate.counter += 1
    while engine.has_unfinished_requests:
        for o in engine.step():
            if o.request_id not in outs:
                continue
            out = outs[o.request_id]
            out.token_ids += o.new_token_ids
            out.text += o.text_delta
            if o.hidden_states is not None:
                prev = out.tensors
                out.tensors = {str(k): torch.cat([prev[str(k)], v]) if str(k) in prev else v
                               for k, v in o.hidden_states.items()}
            if o.finished:
                out.finish_reason, out.error = o.finish_reason.value, o.error
                out.metrics = o.metrics
    return list(outs.values())


generate.counter = 0


def run_batch(path: Path, prompts: list[list[int]], **engine_kw: object
              ) -> tuple[AREngine, list[OmniOutput]]:
    engine = make_engine(path, **engine_kw)
    return engine, generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_tied", "tiny_qwen2"])
def test_golden_batch_chunked_prefix_cached(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    prompts = make_prompts(omni_vocab(path))
    engine, outs = run_batch(path, prompts, max_num_batched_tokens=64, enable_prefix_caching=True)
    for prompt, out in zip(prompts, outs):
        expected = reference(path, prompt)
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason in ("length", "stop")
    # Every prompt's full blocks are in the cache now: the same batch again hits them.
    again = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert sum(o.metrics.num_cached_tokens for o in again) > 0


def test_golden_under_preemption(tiny_qwen3: Path) -> None:
    prompts = make_prompts(omni_vocab(tiny_qwen3), seed=1)
    engine, outs = run_batch(tiny_qwen3, prompts, max_num_batched_tokens=32, num_kv_blocks=16)
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(tiny_qwen3, prompt), f"prompt of {len(prompt)} tokens"
    assert engine.block_manager.num_free_blocks == 16


def test_prefix_cache_computes_only_the_tail(tiny_qwen3: Path) -> None:
    rng = random.Random(3)
    vocab = omni_vocab(tiny_qwen3)
    prefix = [rng.randrange(vocab) for _ in range(64)]
    first = prefix + [rng.randrange(vocab) for _ in range(10)]
    second = prefix + [rng.randrange(vocab) for _ in range(7)]
    params = SamplingParams(temperature=0.0, max_tokens=8)

    engine = make_engine(tiny_qwen3)
    generate(engine, [first], params)
    before = engine.num_computed_tokens_total
    (out,) = generate(engine, [second], params)
    computed = engine.num_computed_tokens_total - before
    assert out.metrics.num_cached_tokens == 64
    assert computed == len(second) - 64 + (8 - 1)  # the tail, then one token per decode step

    plain = make_engine(tiny_qwen3, enable_prefix_caching=False)
    (ref,) = generate(plain, [second], params)
    assert ref.metrics.num_cached_tokens == 0
    assert out.token_ids == ref.token_ids == reference(tiny_qwen3, second, 8)


def test_seeded_request_is_batch_invariant(tiny_qwen3: Path) -> None:
    engine = make_engine(tiny_qwen3)
    vocab = omni_vocab(tiny_qwen3)
    rng = random.Random(5)
    target = [rng.randrange(vocab) for _ in range(20)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    (alone,) = generate(engine, [target], seeded)

    for i in range(15):
        other = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        engine.add_request(f"other{i}", other,
                           SamplingParams(temperature=0.8, max_tokens=rng.randrange(4, 30),
                                          seed=i if i % 2 else None))
    (batched,) = generate(engine, [target], seeded)
    assert batched.token_ids == alone.token_ids
    (other_seed,) = generate(engine, [target], SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                             max_tokens=16, ignore_eos=True))
    assert other_seed.token_ids != alone.token_ids


def test_hidden_states_and_prompt_embeds(tiny_qwen3: Path) -> None:
    """A request can emit hidden states of chosen layers and take prompt embeddings."""
    engine = make_engine(tiny_qwen3, max_num_batched_tokens=16)
    prompt = list(range(5, 45))
    layers = (0, 1, engine.model_config.num_hidden_layers)
    (out,) = generate(engine, [prompt],
                      SamplingParams(temperature=0.0, max_tokens=6, output_hidden_layers=layers))
    hf = _hf_model(tiny_qwen3)
    full = torch.tensor([prompt + out.token_ids[:-1]])
    with torch.no_grad():
        ref = hf(full, output_hidden_states=True).hidden_states
    for layer in layers:
        got = out.tensors[str(layer)]
        assert got.shape[0] == full.shape[1]  # every computed position exactly once
        torch.testing.assert_close(got, ref[layer][0], atol=1e-4, rtol=1e-4)

    # prompt embeddings equal to the token embeddings give the same tokens, mixed in one batch
    embeds = hf.get_input_embeddings()(torch.tensor(prompt)).detach()
    params = SamplingParams(temperature=0.0, max_tokens=6)
    a, b = generate(engine, [{"prompt_embeds": embeds}, prompt], params)
    assert a.token_ids == b.token_ids == out.token_ids


def test_step_failure_fails_only_that_batch(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(tiny_qwen3)
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(batch)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    (failed,) = generate(engine, [[1, 2, 3]], SamplingParams(temperature=0))
    assert failed.finish_reason == "error" and "boom" in str(failed.error)
    assert engine.block_manager.num_free_blocks == engine.kv_layout.num_blocks
    (ok,) = generate(engine, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert ok.finish_reason in ("length", "stop") and ok.error is None


def omni_vocab(path: Path) -> int:
    import json

    return json.loads((path / "config.json").read_text())["vocab_size"]


def test_max_model_len_above_the_model_limit_is_refused(tiny_qwen3: Path) -> None:
    """Not capped silently: the caller asked for more than the model's positions allow."""
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds the model's "
                                         "max_position_embeddings 512"):
        AREngine(ARConfig(model=str(tiny_qwen3), device="cpu",
                          scheduler=SchedulerConfig(max_model_len=100_000)))
