"""The AR engine's shadow sequences on CUDA (VibeVoice: the CFG negative and token-CFG contexts
beside their owner, CUDA graphs of the owners' plain decodes, async scheduling): ids identical
to transformers' generate on the CPU, latents and audio within float32 device tolerances; two
requests joining at different steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig, KVCacheConfig
from omnistage.generation.vibevoice import VibeVoiceSpeaker
from omnistage.models.vibevoice.model import VibeVoiceForConditionalGeneration
from omnistage.models.vibevoice.prompt import prompt_embeds
from tests.helpers.vibevoice import AUDIO_BOS, build_tiny_vibevoice, reference_generate

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("no_tf32")]
PROMPT = [5, 17, 99, 3, 42, 7, AUDIO_BOS]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vibevoice(tmp_path_factory.mktemp("vibevoice_cuda"), 0)


def load(path: Path, device: torch.device, dtype: torch.dtype | None):
    model = VibeVoiceForConditionalGeneration.from_pretrained(path, device, torch.float32)
    return model, model.model_config, None


def test_vibevoice_on_cuda_equals_transformers(root: Path) -> None:
    engine = AREngine(ARConfig(model=str(root), device="cuda", dtype="float32",
                               kv_cache=KVCacheConfig(block_size=16, num_blocks=64)), loader=load)
    engine.capture_decode_graphs(embeds=True)
    speaker = VibeVoiceSpeaker(engine)
    cases = {"a": (PROMPT, 11, 1.3, 5, 12), "b": ([8, 8, 31, 77, AUDIO_BOS], 23, 1.5, 4, 9)}
    for i, (rid, (ids, seed, g, steps, max_new)) in enumerate(cases.items()):
        embeds = prompt_embeds(speaker.model, torch.tensor(ids, device="cuda"), [])
        speaker.add(rid, embeds, ids[-1], max_new, torch.Generator().manual_seed(seed), g,
                    steps)
        for _ in range(3 if i == 0 else 0):       # b joins a running
            engine.step()
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None, out.error
    for rid, (ids, seed, g, steps, max_new) in cases.items():
        ref = reference_generate(root, ids, seed, max_new, g, steps)
        got = speaker.drop(rid)
        assert got.tokens == ref["tokens"], rid
        assert ref["audio"].abs().mean() > 1.0
        torch.testing.assert_close(torch.cat(got.audio).cpu(), ref["audio"], atol=2e-3,
                                   rtol=1e-3)
