"""Golden: our CosyVoice3 speech-token LM (omnistage/models/cosyvoice3/llm.py) on the AR engine
against the upstream CosyVoice3LM.inference (tests/fixtures/cosyvoice3, greedy in place of
ras_sampling) on the same tiny Qwen2 redrawn from the fixture's seed, loaded from the released
layout (llm.pt, CosyVoice-BlankEN/config.json): the same speech tokens, every step's
log-probabilities within 1e-4."""

from __future__ import annotations

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig, KVCacheConfig
from omnistage.layers.attention import forward_context
from omnistage.models.cosyvoice3.llm import CosyVoice3LM
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_models import PagedCache
from tests.helpers.cosyvoice3 import expected, manifest, write_llm


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_llm(tmp_path_factory.mktemp("cosyvoice3_llm"))


def _load(speech_token_size):
    def load(path, device, dtype):   # the engine is pointed at the decoder's config folder
        model = CosyVoice3LM.from_pretrained(path.parent, speech_token_size, device, dtype)
        return model, model.model_config, None
    return load


def test_logprobs_equal_upstream_step_by_step(folder):
    """Teacher-forced on upstream's tokens, no engine: prefill + each decode's log-probs."""
    m, exp = manifest(), expected()
    model = CosyVoice3LM.from_pretrained(folder, m["llm"]["speech_token_size"])
    text = torch.cat([exp["llm.prompt_text"][0], exp["llm.text"][0]])
    tokens = exp["llm.tokens"]
    with torch.no_grad():
        rows = torch.cat([model.prompt_embeds(text, exp["llm.prompt_speech"][0]),
                          model.embed_input_ids(tokens[:-1])])
        md, positions = PagedCache(model, block_size=4).step([(0, len(rows))])
        with forward_context(md):
            hidden, _ = model(torch.zeros(len(rows), dtype=torch.long), positions, rows)
        logp = model.compute_logits(hidden).log_softmax(-1)[-len(tokens):]
    want = exp["llm.logp"]
    assert want.std() > 0.1
    torch.testing.assert_close(logp, want, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_on_the_engine_equal_upstream(folder):
    m, exp = manifest(), expected()
    s = m["llm"]["speech_token_size"]
    engine = AREngine(ARConfig(model=str(folder / "CosyVoice-BlankEN"), device="cpu", dtype="float32",
                               kv_cache=KVCacheConfig(block_size=4)), loader=_load(s))
    model = engine.model
    text = torch.cat([exp["llm.prompt_text"][0], exp["llm.text"][0]])
    with torch.no_grad():
        prompt = model.prompt_embeds(text, exp["llm.prompt_speech"][0])
    want = exp["llm.tokens"].tolist()
    max_len = len(exp["llm.text"][0]) * m["llm_case"]["max_token_text_ratio"]
    params = SamplingParams(temperature=0.0, max_tokens=max_len,
                            stop_token_ids=model.stop_token_ids)
    engine.add_request("r", [0] * len(prompt), params, prompt_embeds=prompt)
    tokens: list[int] = []
    for _ in range(200):
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            tokens += out.new_token_ids
    assert len(set(want)) >= 3, "the tiny LM should say several tokens"
    assert [t for t in tokens if t < s] == want


def test_a_prompt_without_endofprompt_is_refused(folder):
    m, exp = manifest(), expected()
    model = CosyVoice3LM.from_pretrained(folder, m["llm"]["speech_token_size"])
    with pytest.raises(ValueError, match="endofprompt"):
        model.prompt_embeds(exp["llm.text"][0], exp["llm.prompt_speech"][0])
