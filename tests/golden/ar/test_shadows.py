"""Shadow sequences through the engine on a tiny Qwen3: the hidden states the feedback hook
reads from a shadow equal transformers' model run on that shadow's rows alone, the owners'
tokens stay transformers' greedy ones, and rollback / restart / preemption keep it so."""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.ar import shadows
from omnistage.sampling_params import SamplingParams
from tests.golden.ar.test_engine import _hf_model, generate, make_engine, reference


def shadow_hook(engine, seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]):
    """Feeds each request's shadow the embedding of every sampled token; every third token
    the row is rolled back again, at the fifth the context restarts."""
    embed = engine.model.embed_input_ids if hasattr(engine.model, "embed_input_ids") else None

    def hook(last, token_ids, seqs):
        emb = engine.runner.embed(token_ids) if embed is None else embed(token_ids)
        for j, seq in enumerate(seqs):
            sh = seq.shadows["ctx"]
            kept = sh.prompt.embeds[:sh.num_computed_tokens].clone()
            seen.setdefault(seq.request_id, []).append((kept, sh.last_hidden.clone()))
            n = seq.num_output_tokens + 1            # this token's index, from 1
            if n % 3 == 0:
                shadows.rollback(sh, 1)
            if n == 5:
                shadows.restart(sh, emb[j:j + 1])
            else:
                shadows.feed(sh, emb[j:j + 1])
        return emb, [None] * len(seqs)
    return hook


def run(path: Path, prompts: list[list[int]], starts: list[torch.Tensor], **engine_kw):
    engine = make_engine(path, **engine_kw)
    seen: dict = {}
    engine.model.feedback = shadow_hook(engine, seen)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    rids = [f"g{generate.counter}-{i}" for i in range(len(prompts))]
    for rid, p, start in zip(rids, prompts, starts):
        engine.add_request(rid, p, params)
        engine.add_shadow(rid, "ctx", start)
    outs = {}
    while engine.has_unfinished_requests:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    generate.counter += 1
    return engine, [outs[r] for r in rids], [seen[r] for r in rids]


def check(path: Path, prompts, starts, **engine_kw) -> None:
    engine, tokens, seen = run(path, prompts, starts, **engine_kw)
    hf = _hf_model(path)
    for p, toks, rows in zip(prompts, tokens, seen):
        assert toks == reference(path, p, 8)
        assert len(rows) == len(toks) >= 7          # one hook call per token (eos may end it)
        for kept, got in rows:
            with torch.no_grad():
                ref = hf.model(inputs_embeds=kept[None]).last_hidden_state[0, -1]
            assert ref.abs().max() > 0.1
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_shadow_hidden_states_equal_transformers(tiny_qwen3: Path) -> None:
    g = torch.Generator().manual_seed(0)
    hf = _hf_model(tiny_qwen3)
    hidden = hf.config.hidden_size
    prompts = [[5, 9, 13], list(range(20, 57))]
    starts = [torch.randn(4, hidden, generator=g), torch.randn(19, hidden, generator=g)]
    check(tiny_qwen3, prompts, starts, max_num_batched_tokens=24, block_size=4)


def test_shadows_survive_preemption(tiny_qwen3: Path) -> None:
    g = torch.Generator().manual_seed(1)
    hidden = _hf_model(tiny_qwen3).config.hidden_size
    prompts = [list(range(3, 14)), list(range(30, 41)), list(range(60, 66))]
    starts = [torch.randn(3, hidden, generator=g) for _ in prompts]
    engine, *_ = run(tiny_qwen3, prompts, starts, num_kv_blocks=14, block_size=4)
    assert engine.scheduler.num_preemptions > 0
    check(tiny_qwen3, prompts, starts, num_kv_blocks=14, block_size=4)
