"""Golden: BAGEL's text answers on our AR engine (paged KV cache, chunked prefill, two
requests batched), the understanding expert loaded from ema.safetensors into our
Qwen2ForCausalLM (models/bagel/understanding.py): greedy tokens equal the upstream
inferencer's (tests/fixtures/bagel/, text case) and, for a second prompt of two segments, our
native MoT model's (itself golden against the upstream: test_bagel.py)."""

from __future__ import annotations

import pytest

from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig
from omnistage.models.bagel.generate import SpecialTokens, build_contexts, greedy_text
from omnistage.models.bagel.model import Bagel
from omnistage.models.bagel.understanding import answer_prompt, load_understanding
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer
from tests.helpers.bagel import expected, manifest, write_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("bagel") / "BAGEL-tiny")
    build_tiny_tokenizer(path)      # the engine's detokenizer; prompts are the fixtures' ids
    return path


def test_engine_answers_equal_upstream_and_native(folder):
    m, exp = manifest(), expected()
    s = m["special_tokens"]
    tok = SpecialTokens(s["bos_token_id"], s["eos_token_id"], s["start_of_image"],
                        s["end_of_image"])
    case = m["cases"]["text"]
    first = [list(case["prompt"].encode())]
    second = [list(b"You answer briefly."), list(b"Name a colour.")]
    model, vae = Bagel.from_pretrained(folder)
    native = greedy_text(model, build_contexts(model, vae, second, tok, False).main, tok, 9)

    engine = AREngine(ARConfig(model=str(folder), device="cpu", dtype="float32",
                               kv_cache=KVCacheConfig(block_size=4),
                               scheduler=SchedulerConfig(max_num_batched_tokens=12)),
                      loader=load_understanding)
    params = SamplingParams(temperature=0.0, max_tokens=case["max_think_token_n"] - 1,
                            ignore_eos=True, stop_token_ids=[tok.eos])
    for rid, segs in (("a", first), ("b", second)):
        engine.add_request(rid, answer_prompt(segs, tok.bos, tok.eos), params)
    got: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(200):
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    want = exp["text.tokens"].tolist()[1:]
    assert got["a"] == want, (got["a"], want)
    assert got["b"][:len(native)] == native and len(set(native)) > 2, (got["b"], native)
