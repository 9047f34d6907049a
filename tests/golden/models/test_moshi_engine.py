"""Golden: Moshi's per-frame step on our paged AR engine (omnistage/models/moshi/engine_model.py:
the temporal transformer on the KV cache, the depth transformer in the feedback hook, the
user's codes as the request's stream rows) gives the text tokens and audio frames of
`MoshiForConditionalGeneration.generate`, itself golden against transformers (test_moshi.py):
two requests of different prompt lengths in one engine."""

from __future__ import annotations

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.ar.inputs import StreamInput
from omnistage.configs.schema import ARConfig, KVCacheConfig
from omnistage.models.moshi.engine_model import MoshiStepLM, join_frames
from omnistage.models.moshi.model import MoshiForConditionalGeneration, MoshiPrompt
from omnistage.models.qwen3_omni.talker import FRAME_CODES
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_moshi import build_tiny_moshi

K, FRAME, NUM_FRAMES = 3, 96, 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path, _ = build_tiny_moshi(tmp_path_factory.mktemp("moshi_engine") / "moshi")
    return path


def _prompt(moshi: MoshiForConditionalGeneration, num: int, seed: int) -> MoshiPrompt:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 50, (num,), generator=g)
    user = 0.3 * torch.randn(1, 1, num * FRAME, generator=g)
    codes = torch.randint(0, 64, (K, num), generator=g)
    return MoshiPrompt(text, moshi.audio_encoder.encode(user, K)[0], codes)


def test_engine_frames_equal_generate(folder):
    ref = MoshiForConditionalGeneration.from_pretrained(folder)
    prompts = {"a": _prompt(ref, 3, 1), "b": _prompt(ref, 5, 2)}
    want = ref.generate(list(prompts.values()), NUM_FRAMES)
    silence = ref.silence_codes()

    def load(path, device, dtype):
        model = MoshiStepLM.from_pretrained(path, device, dtype)
        return model, model.model_config, None
    engine = AREngine(ARConfig(model=str(folder), device="cpu", dtype="float32",
                               kv_cache=KVCacheConfig(block_size=4)), loader=load)
    model = engine.model
    for rid, prompt in prompts.items():
        row0, pad = model.user_rows(prompt, silence)
        engine.add_request(rid, None, SamplingParams(temperature=0.0, max_tokens=NUM_FRAMES),
                           prompt_embeds=model.prompt_embeds(prompt),
                           stream=StreamInput(embeds=row0, open=False, pad=pad))
    text: dict[str, list[int]] = {rid: [] for rid in prompts}
    codes: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None, out.error
            text[out.request_id] += out.new_token_ids
            if out.extra is not None:
                codes[out.request_id] += list(out.extra[FRAME_CODES].reshape(-1, K))
    for i, rid in enumerate(prompts):
        assert text[rid] == want.text_ids[i].tolist()
        assert torch.equal(join_frames(codes[rid][:NUM_FRAMES]), want.audio_codes[i])
