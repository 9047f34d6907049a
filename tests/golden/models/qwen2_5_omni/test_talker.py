"""Golden: the Qwen2.5-Omni talker on the AR engine vs transformers' `generate(return_audio=
True)`, float32, greedy with the reference's repetition penalty: given the thinker's states
the reference feeds its talker, the same codec tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.ar.inputs import StreamInput
from omnistage.configs.schema import ARConfig, KVCacheConfig
from omnistage.layers.attention import forward_context
from omnistage.models.qwen2_5_omni.talker import Qwen2_5OmniTalkerForCausalLM
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_models import PagedCache
from omnistage.testing.tiny_qwen2_5_omni import CODEC_BOS, CODEC_EOS, CODEC_PAD, mask_the_talker

THINKER_TOKENS = 8
TALKER_TOKENS = 40


@pytest.fixture(scope="module")
def reference(omni25_hf) -> dict:
    """The reference's talker inputs (thinker space, before its own additions) and codes."""
    hf, seen = omni25_hf, {}
    generate = hf.talker.generate

    def spy(**kwargs):
        seen.update(inputs_embeds=kwargs["inputs_embeds"].clone(),
                    reply=kwargs["thinker_reply_part"].clone(), ids=kwargs["input_ids"].clone())
        out = generate(**kwargs)
        seen["codes"] = out[0, kwargs["input_ids"].shape[1]:].tolist()
        return out

    hf.talker.generate = spy
    handle = mask_the_talker(hf.talker)
    hf.token2wav.forward = lambda codes, **_: torch.zeros(1)   # not under test here
    try:
        ids = torch.randint(0, 400, (1, 14), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), speaker="Chelsie",
                        thinker_do_sample=False, thinker_max_new_tokens=THINKER_TOKENS,
                        talker_do_sample=False, talker_max_new_tokens=TALKER_TOKENS,
                        talker_eos_token_id=[CODEC_PAD, CODEC_EOS])
    finally:
        hf.talker.generate = generate
        handle.remove()
        del hf.token2wav.forward
    return seen


def test_codes_equal_hf_given_thinker_states(omni25_path: Path, reference: dict) -> None:
    def load(path, device, dtype):
        model = Qwen2_5OmniTalkerForCausalLM.from_pretrained(path, device, dtype)
        return model, model.model_config, None

    engine = AREngine(ARConfig(model=str(omni25_path), device="cpu", dtype="float32",
                               kv_cache=KVCacheConfig(block_size=4)), loader=load)
    talker = engine.model
    rows, reply = reference["inputs_embeds"][0], reference["reply"][0]
    with torch.no_grad():
        prompt = talker.prompt_embeds(rows[:-2], rows[-2], rows[-1])
        stream = StreamInput(talker.project_stream(reply[:-1]), open=False,
                             pad=talker.project_stream(reply[-1]))
    ids = reference["ids"][0].tolist()
    params = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=TALKER_TOKENS)
    engine.add_request("t", ids, params, prompt_embeds=prompt, stream=stream)
    codes: list[int] = []
    for _ in range(200):
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            codes += out.new_token_ids
    expected = reference["codes"]
    assert len(set(expected)) > 5, "the tiny talker should say several codes"
    assert codes[:len(expected)] == expected


def test_decode_logits_match_hf(omni25_path: Path, omni25_hf, reference: dict) -> None:
    """Prefill, then decodes fed code embedding + stream row through our paged cache, against
    the reference's talker run over the same inputs at once (its codec pad / bos added)."""
    hf = omni25_hf.talker
    talker = Qwen2_5OmniTalkerForCausalLM.from_pretrained(omni25_path)
    rows, reply = reference["inputs_embeds"][0], reference["reply"][0]
    codes = torch.tensor(reference["codes"][:4])
    x = rows.clone()
    x[-2] += hf.model.embed_tokens.weight[CODEC_PAD]
    x[-1] += hf.model.embed_tokens.weight[CODEC_BOS]
    x = torch.cat([x, hf.model.embed_tokens(codes) + reply[:4]])
    with torch.no_grad():
        expected = hf.codec_head(hf.model(inputs_embeds=hf.thinker_to_talker_proj(x)[None])
                                 .last_hidden_state)[0, rows.shape[0] - 1:]
        cache = PagedCache(talker, block_size=4)
        steps = [talker.prompt_embeds(rows[:-2], rows[-2], rows[-1])]
        steps += [talker.embed_input_ids(codes[i:i + 1]) + talker.project_stream(reply[i:i + 1])
                  for i in range(4)]
        logits = []
        for embeds in steps:
            md, positions = cache.step([(0, embeds.shape[0])])
            with forward_context(md):
                hidden, _ = talker(codes[:1], positions.expand(3, -1), embeds)
            logits.append(talker.compute_logits(hidden[-1:]))
    got = torch.cat(logits)
    keep = ~talker.suppressed
    assert expected.std() > 0.3
    torch.testing.assert_close(got[:, keep], expected[:, keep], atol=1e-4, rtol=1e-4)
