"""Golden fixtures for Voxtral-TTS (issue 43): the codec decoder (codes -> waveform), the
acoustic generation head (semantic code + 7-step flow matching with CFG) and the packed
37-codebook input embedding, from vLLM-Omni's reference modules, run in the reference env:

    /work/ref-voxtral/bin/python scripts/voxtral_tts_fixtures.py /path/to/voxtral_tts

The folder holds linyueqian/vllm-omni @ 0342827dd787296b8a6b1e9f523ebaa24d13c714,
vllm_omni/model_executor/models/voxtral_tts/ (voxtral_tts_audio_tokenizer.py,
voxtral_tts_audio_generation.py). vLLM, mistral_common and transformers are not installed there:
their imports are stubbed (only serving glue: loggers, registries, processor base classes).
flash_attn is absent, so the codec runs its SDPA path (ALiBi + causal sliding window).

Writes tests/fixtures/voxtral_tts/: tiny/params.json (Mistral layout: `multimodal.audio_model_args`,
`multimodal.audio_tokenizer_args`), tiny/consolidated.safetensors (the released key names:
`audio_tokenizer.*` decoder + quantizer, `acoustic_transformer.*`,
`mm_audio_embeddings.audio_codebook_embeddings.embeddings.weight`; no encoder, as released) and
expected.safetensors (inputs and the reference's outputs)."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import types
from pathlib import Path

import torch

PINNED = "linyueqian/vllm-omni@0342827dd787296b8a6b1e9f523ebaa24d13c714"
OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "voxtral_tts"
PKG = "vllm_omni.model_executor.models.voxtral_tts"

HIDDEN = 32
AUDIO_MODEL_ARGS = dict(
    semantic_codebook_size=40, acoustic_codebook_size=21, n_acoustic_codebook=6,
    audio_token_id=24, begin_audio_token_id=25,
    audio_encoding_args=dict(sampling_rate=24000, frame_rate=12.5),
    acoustic_transformer_args=dict(input_dim=HIDDEN, dim=HIDDEN, n_layers=2, head_dim=8,
                                   hidden_dim=48, n_heads=4, n_kv_heads=2, use_biases=False,
                                   norm_eps=1e-5, n_decoding_steps=7))
CODEC_ARGS = dict(
    channels=1, sampling_rate=24000, pretransform_patch_size=8, patch_proj_kernel_size=3,
    semantic_codebook_size=40, semantic_dim=12, acoustic_codebook_size=21, acoustic_dim=6,
    dim=24, hidden_dim=40, head_dim=6, n_heads=4, n_kv_heads=2, norm_eps=1e-2,
    qk_norm_eps=1e-6, attn_sliding_window_size=16,
    encoder_transformer_lengths_str="1,1,1,1", encoder_convs_kernels_str="4,4,4,3",
    encoder_convs_strides_str="2,2,2,1", decoder_transformer_lengths_str="1,2,1,1",
    decoder_convs_kernels_str="3,4,4,4", decoder_convs_strides_str="1,2,2,2",
    voice={"tiny_voice": 0})


class _Anything(type):
    """A stand-in class: subscriptable (Generic[...] bases), any attribute, any call."""

    def __getitem__(cls, _item):
        return cls

    def __getattr__(cls, _name):
        return cls


class _Stub(metaclass=_Anything):
    def __init__(self, *a, **k) -> None:
        pass


class _Registry:
    @staticmethod
    def register_processor(*_a, **_k):
        return lambda c: c


def _stub_module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []                                   # a package: submodules may follow
    mod.__getattr__ = lambda _n: _Stub                   # type: ignore[method-assign]
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    return mod


def _install_stubs() -> None:
    for name in ["vllm", "vllm.config", "vllm.inputs", "vllm.model_executor",
                 "vllm.model_executor.model_loader", "vllm.model_executor.models",
                 "vllm.model_executor.models.interfaces", "vllm.model_executor.models.utils",
                 "vllm.multimodal.inputs", "vllm.multimodal.parse",
                 "vllm.multimodal.processing", "vllm.multimodal.processing.processor",
                 "vllm.sequence", "vllm.tokenizers", "vllm.tokenizers.mistral",
                 "mistral_common", "mistral_common.protocol", "mistral_common.protocol.instruct",
                 "mistral_common.protocol.instruct.chunk", "mistral_common.tokens",
                 "mistral_common.tokens.tokenizers", "mistral_common.tokens.tokenizers.audio",
                 "transformers", "transformers.tokenization_utils_base", "regex",
                 "vllm_omni", "vllm_omni.model_executor", "vllm_omni.model_executor.models",
                 "vllm_omni.quantization", "vllm_omni.quantization.component_config", PKG]:
        _stub_module(name)
    _stub_module("vllm.logger", init_logger=logging.getLogger)
    _stub_module("vllm.multimodal", MULTIMODAL_REGISTRY=_Registry())

    def default_weight_loader(param, w):
        param.data.copy_(w)

    _stub_module("vllm.model_executor.model_loader.weight_utils",
                 default_weight_loader=default_weight_loader)
    _stub_module("vllm_omni.platforms",
                 current_omni_platform=types.SimpleNamespace(device_type="cpu"))


def _load(folder: Path, stem: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"{PKG}.{stem}", folder / f"{stem}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _randomize(module: torch.nn.Module, scale: float) -> None:
    """Random weights of audible size (layer scales and norms away from their inits)."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * scale / fan_in ** 0.5)


def _codec(tok_mod, n_frames: int) -> tuple[torch.nn.Module, dict]:
    cfg = types.SimpleNamespace(
        audio_config={"codec_args": dict(CODEC_ARGS), "audio_model_args": AUDIO_MODEL_ARGS},
        text_config=types.SimpleNamespace(hidden_size=HIDDEN))
    vc = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=cfg))
    codec = tok_mod.VoxtralTTSAudioTokenizer(vllm_config=vc).eval()
    _randomize(codec, 1.5)
    with torch.no_grad():
        sem = codec.quantizer.semantic_codebook
        g = torch.Generator().manual_seed(7)
        sem.embedding_sum.copy_(torch.randn(sem.embedding_sum.shape, generator=g) * 3.0)
        sem.cluster_usage.copy_(torch.rand(sem.cluster_usage.shape, generator=g) * 4 + 0.5)
        sem._embedding = None
    g = torch.Generator().manual_seed(11)
    codes = torch.cat([torch.randint(0, 40, (2, 1, n_frames), generator=g),
                       torch.randint(0, 21, (2, 6, n_frames), generator=g)], dim=1)
    with torch.no_grad():
        wav = codec.decode(codes)
    return codec, {"codec_codes": codes, "codec_wav": wav}


def _head(gen_mod, codec) -> tuple[torch.nn.Module, dict]:
    head = gen_mod.FlowMatchingAudioTransformer(json.loads(json.dumps(AUDIO_MODEL_ARGS))).eval()
    _randomize(head, 1.0)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, HIDDEN, generator=g) * 2.0
    with torch.no_grad():
        hidden[2] = head.semantic_codebook_output.weight[1] * 20.0     # row 2 says [END_AUDIO]
    cfg_alpha = torch.tensor([1.2, 1.0, 1.5])
    torch.manual_seed(99)
    noise = torch.randn(3, 6)
    torch.manual_seed(99)
    with torch.no_grad():
        codes = head(hidden, cfg_alpha)
        t_emb = head.time_embedding(torch.full((3, 1), 2 / 7))
        velocity = head._predict_velocity(noise, hidden, t_emb)
    # the next step's input: AR-space codes (+2 specials) of 2 sequences x 3 frames, summed
    g = torch.Generator().manual_seed(5)
    frames = torch.cat([torch.randint(0, 42, (2, 1, 3), generator=g),
                        torch.randint(2, 23, (2, 6, 3), generator=g)], dim=1)
    with torch.no_grad():
        emb = torch.stack(codec.encode_tokens([f[None] for f in frames]))
    return head, {"head_hidden": hidden, "head_cfg_alpha": cfg_alpha, "head_noise": noise,
                  "head_codes": codes, "head_velocity_t2": velocity,
                  "embed_codes": frames, "embed_sum": emb}


def main() -> None:
    folder = Path(sys.argv[1])
    _install_stubs()
    gen_mod = _load(folder, "voxtral_tts_audio_generation")
    tok_mod = _load(folder, "voxtral_tts_audio_tokenizer")
    torch.manual_seed(0)
    codec, expected = _codec(tok_mod, n_frames=7)
    head, more = _head(gen_mod, codec)
    expected.update(more)
    print("wav std", expected["codec_wav"].std().item(), "shape", tuple(expected["codec_wav"].shape))
    print("head codes", expected["head_codes"].tolist())
    print("velocity std", expected["head_velocity_t2"].std().item())

    from safetensors.torch import save_file
    weights = {f"audio_tokenizer.{k}": v for k, v in codec.state_dict().items()
               if not k.startswith(("input_proj.", "encoder_blocks.", "audio_token_embedding."))}
    weights["mm_audio_embeddings.audio_codebook_embeddings.embeddings.weight"] = \
        codec.audio_token_embedding.embeddings.weight
    weights.update({f"acoustic_transformer.{k}": v for k, v in head.state_dict().items()})
    tiny = OUT / "tiny"
    tiny.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, tiny / "consolidated.safetensors")
    params = {"dim": HIDDEN, "model_type": "voxtral_tts",
              "multimodal": {"bos_token_id": 1, "audio_model_args": AUDIO_MODEL_ARGS,
                             "audio_tokenizer_args": CODEC_ARGS}}
    (tiny / "params.json").write_text(json.dumps(params, indent=1) + "\n")
    save_file({k: v.contiguous() for k, v in expected.items()}, OUT / "expected.safetensors",
              metadata={"reference": PINNED})
    print("wrote", OUT)


if __name__ == "__main__":
    main()
