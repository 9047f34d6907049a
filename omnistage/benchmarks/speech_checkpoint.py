"""Random-weight checkpoint folders of CosyVoice3, Voxtral-TTS and MiMo-Audio for `bench speech`
(speech.py): at the released shapes (below), or the tests' tiny folders (tests/helpers/).

Every folder is laid out as the release ships it and read by the family's own loader; the
tensors are drawn per name on the device (`common.seeded_tensor`: N(0, 1/fan_in), norm scales
near 1), under the names the family's loader reads (Voxtral's codec: ours, which its loader's
`fold` passes through; the rest: the release's). Each
family's weights are then changed so that a random model speaks a fixed length (`force_*`):

    cosyvoice3   the LM's 200 stop rows zeroed (as the golden fixture's): greedy never stops
    voxtral-tts  the head's [END_AUDIO] row zeroed: the semantic argmax never ends the frame run
    mimo-audio   a constant direction put in every final hidden state (the last layer's value
                 bias, as tests/helpers/mimo_audio.py does) and read by <|empty|>'s lm_head row
                 only: greedy speaks a patch at every step

Real shapes and where they come from (the docs pages and config classes hold some; the rest
are the public model cards' / public ports' numbers, as noted):

    cosyvoice3   Fun-CosyVoice3-0.5B-2512: LM Qwen2.5-0.5B (24 x 896, 14 / 2 heads, 4864 MLP,
                 151936 ids) + 6561 speech ids; flow DiT 22 x 1024, 16 heads of 64, ff x2,
                 spk 192, look-ahead channels 1024; HiFT base 512 channels, f0 cond 512 (from
                 the public ports of cosyvoice3.yaml: mlx-audio's CosyVoice3 config)
    voxtral-tts  Voxtral-4B-TTS-2603: backbone 26 x 3072, 32 / 8 heads of 128, 9216 MLP,
                 131072 ids (Ministral-3B's, the public params.json); head and codec at
                 models/voxtral_tts/config.py's defaults (the release's); 4.0 B in all
    mimo-audio   MiMo-Audio-7B-Instruct: LLM 36 x 4096, 32 / 8 heads of 128, 11008 MLP, 151680
                 ids, rope 640000; patch decoder 16 x 1024, patch encoder 6 x 1024 (64 heads);
                 MiMo-Audio-Tokenizer (1.2 B): 32 + 32 layers of 1280, vocoder 16 x 256
                 (from the public sglang-jax MiMo-Audio configs). One change: 8 quantizers,
                 not the release's 20 (the LLM speaks 8 channels and decoding reads 8 codebooks;
                 generation/mimo_audio.py sizes its stream by the tokenizer's codebook count,
                 which fails at 20: "Expected size 20 but got size 8")

The text tokenizers are the tiny test ones (prompt ids are few; every table keeps its size);
CosyVoice3's two ONNX front-end files are the tests' stand-ins (the released signature, a
fraction of the real speech tokenizer's cost: its time is not in the figures).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.benchmarks.common import seeded_tensor

FAMILIES = ("cosyvoice3", "voxtral-tts", "mimo-audio")

COSYVOICE3_QWEN2 = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
    intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
COSYVOICE3_FLOW = dict(vocab=6561, spk=192, la_channels=1024, dim=1024, depth=22, heads=16,
                       dim_head=64, ff_mult=2, base_channels=512, f0_channels=512)
VOXTRAL_BACKBONE = dict(dim=3072, n_layers=26, head_dim=128, hidden_dim=9216, n_heads=32,
                        n_kv_heads=8, norm_eps=1e-5, vocab_size=131072, rope_theta=1e6,
                        max_seq_len=65536)
VOXTRAL_HEAD: dict = {}                  # HeadConfig / CodecConfig fields to change (none: the
VOXTRAL_CODEC: dict = {}                 # release's; the tests shrink them)
MIMO_LLM = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=11008, vocab_size=151680,
                max_position_embeddings=8192, rope_theta=640000.0, local_dim=1024,
                local_layers=16, local_attn_heads=64, local_ffn_dim=4096, input_local_dim=1024,
                input_local_layers=6, input_full_attention=True,
                speech_vocab_size="1025-1025-129-129-129-129-129-129",
                speech_zeroemb_idx="1024-1024-128-128-128-128-128-128")
MIMO_TOKENIZER = dict(
    architectures=["MiMoAudioTokenizer"], model_type="mimo_audio_tokenizer",
    sampling_rate=24000, n_mels=128, nfft=960, hop_length=240, window_size=960, fmin=0,
    fmax=None, kernel_size=3, stride_size=2, d_model=1280, scale_embedding=False,
    activation_function="gelu", encoder_layers=32, encoder_attention_heads=20,
    encoder_ffn_dim=5120, encoder_causal=False, encoder_attn_window_size=[-1, -1],
    encoder_skip_layer_id=3, decoder_layers=32, decoder_attention_heads=20,
    decoder_ffn_dim=5120, decoder_causal=True, decoder_attn_window_size=[-1, -1],
    decoder_kernel_size=3, decoder_stride_size=2, avg_pooler=2, num_quantizers=8,
    codebook_size=[1024, 1024] + [128] * 6, threshold_ema_dead_code=2,
    position_embedding_type="rope", rope_theta=10000, rope_type="default", ln_type="LayerNorm",
    max_audio_seconds=1800, vocoder_dim=256, vocoder_attention_heads=16,
    vocoder_intermediate_dim=1024, vocoder_num_layers=16, vocoder_attn_window_size=[40, 10],
    vocoder_padding="same")


def _helpers() -> None:
    """tests/helpers/ (the tiny builders and their fixtures) importable from the checkout."""
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.append(root)


def random_state(model: nn.Module, seed: int, device: torch.device, dtype: torch.dtype,
                 persistent_buffers: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) for every parameter of `model` drawn on `device`, handed to the host in
    `dtype`; with its persistent buffers as the module holds them (`model` then built on a
    real device; else the meta device will do)."""
    params = dict(model.named_parameters())
    for name, value in model.state_dict().items():
        if name not in params:
            if persistent_buffers:
                yield name, value.cpu()
            continue
        shape = tuple(value.shape)
        is_scale = len(shape) == 1 and name.endswith(("weight", "alpha", "gamma", "scale"))
        yield name, seeded_tensor(name, shape, is_scale, seed, device).to(dtype).cpu()


def unfused(items: Iterator[tuple[str, Tensor]], model: nn.Module
            ) -> Iterator[tuple[str, Tensor]]:
    """Fused projections split back into the checkpoint's tensors (qkv_proj -> q/k/v_proj,
    gate_up_proj -> gate/up_proj, on one rank), the names the released files use."""
    for name, t in items:
        stem, _, leaf = name.rpartition(".")
        if stem.endswith(".qkv_proj"):
            m = model.get_submodule(stem)
            parts = zip(("q_proj", "k_proj", "v_proj"), t.split([m.q_size, m.kv_size,
                                                                  m.kv_size]))
        elif stem.endswith(".gate_up_proj"):
            parts = zip(("gate_proj", "up_proj"),
                        t.split(list(model.get_submodule(stem).output_sizes)))
        else:
            yield name, t
            continue
        base = stem.rpartition(".")[0]
        for part, piece in parts:
            yield f"{base}.{part}.{leaf}", piece.contiguous()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def on_meta(build) -> nn.Module:  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        return build()


# ---- CosyVoice3 ----------------------------------------------------------------------------

def _cosyvoice3_yaml(f: dict) -> str:
    _helpers()
    from tests.helpers.cosyvoice3 import YAML, manifest

    hift = dict(manifest()["hift"], base_channels=f["base_channels"])
    lines = "\n".join(f"    {k}: {json.dumps(v)}" for k, v in hift.items() if k != "sampling_rate")
    return YAML.format(sr=24000, spk=f["spk"], ratio=2, chunk_tokens=25, mel=80,
                       vocab=f["vocab"], lookahead=3, la_channels=f["la_channels"],
                       cfg_rate=0.7, dim=f["dim"], depth=f["depth"], heads=f["heads"],
                       dim_head=f["dim_head"], ff_mult=f["ff_mult"],
                       hift=lines + "\n    sampling_rate: !ref <sample_rate>",
                       f0_channels=f["f0_channels"])


def cosyvoice3_models(folder: Path, device: torch.device | str = "meta"
                      ) -> dict[str, nn.Module]:
    """The folder's flow and HiFT built on `device`, its LM on the meta device."""
    from transformers import Qwen2Config

    from omnistage.models.config import ModelConfig
    from omnistage.models.cosyvoice3.config import CosyVoice3Config
    from omnistage.models.cosyvoice3.flow import CausalMaskedDiffWithDiT
    from omnistage.models.cosyvoice3.hift import CausalHiFTGenerator
    from omnistage.models.cosyvoice3.llm import CosyVoice3LM

    cfg = CosyVoice3Config.from_folder(folder)
    hf = Qwen2Config(**json.loads((folder / "CosyVoice-BlankEN" / "config.json").read_text()))
    with torch.device(device):
        flow, hift = CausalMaskedDiffWithDiT(cfg.flow), CausalHiFTGenerator(cfg.hift)
    return {"flow": flow, "hift": hift,
            "llm": on_meta(lambda: CosyVoice3LM(ModelConfig.from_hf(hf), cfg.speech_token_size))}


def write_cosyvoice3_config(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cosyvoice3.yaml").write_text(_cosyvoice3_yaml(COSYVOICE3_FLOW))
    (folder / "CosyVoice-BlankEN").mkdir(exist_ok=True)
    (folder / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(COSYVOICE3_QWEN2))
    return folder


def build_cosyvoice3(folder: Path, seed: int, device: torch.device) -> Path:
    _helpers()
    from tests.helpers import cosyvoice3 as tiny

    write_cosyvoice3_config(folder)
    models = cosyvoice3_models(folder, device)   # flow, HiFT: their buffers are saved too
    for name in ("flow", "hift"):              # float32 as the stage runs them
        torch.save(dict(random_state(models[name], seed, device, torch.float32, True)),
                   folder / f"{name}.pt")
    llm = dict(unfused(random_state(models["llm"], seed, device, torch.bfloat16),
                       models["llm"]))
    llm["llm_decoder.weight"][COSYVOICE3_FLOW["vocab"]:] = 0      # the stop rows
    torch.save(llm, folder / "llm.pt")
    tiny.write_tokenizer(folder)
    _cosyvoice3_onnx(folder, COSYVOICE3_FLOW["spk"])
    return folder


def _cosyvoice3_onnx(folder: Path, spk_dim: int) -> None:
    """tests/helpers/cosyvoice3.py's ONNX stand-ins, the speaker's width the release's."""
    from tests.helpers import cosyvoice3 as tiny

    tiny.write_onnx(folder, spk_dim)


# ---- Voxtral-TTS ---------------------------------------------------------------------------

def write_voxtral_params(folder: Path) -> dict:
    """params.json at the release's sizes (head and codec: config.py's defaults)."""
    from omnistage.models.voxtral_tts.config import CodecConfig, HeadConfig

    _helpers()
    from tests.helpers.voxtral_tts import FIXTURES

    params = json.loads((FIXTURES / "tiny" / "params.json").read_text())
    params.update(VOXTRAL_BACKBONE)
    h, c = HeadConfig(**VOXTRAL_HEAD), CodecConfig(**VOXTRAL_CODEC)
    am = params["multimodal"]["audio_model_args"]
    am.update(semantic_codebook_size=h.semantic_codebook_size,
              n_acoustic_codebook=h.n_acoustic_codebook,
              acoustic_codebook_size=h.acoustic_codebook_size)
    am["acoustic_transformer_args"].update(
        input_dim=h.input_dim, dim=h.dim, n_layers=h.n_layers, head_dim=h.head_dim,
        hidden_dim=h.hidden_dim, n_heads=h.n_heads, n_kv_heads=h.n_kv_heads)
    at = params["multimodal"]["audio_tokenizer_args"]
    at.update({k: getattr(c, k) for k in (
        "pretransform_patch_size", "patch_proj_kernel_size", "semantic_codebook_size",
        "semantic_dim", "acoustic_codebook_size", "acoustic_dim", "dim", "hidden_dim",
        "head_dim", "n_heads", "n_kv_heads", "norm_eps", "qk_norm_eps")},
              decoder_transformer_lengths_str="2,2,2,2")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.json").write_text(json.dumps(params, indent=1))
    return params


def voxtral_models(folder: Path) -> dict[str, nn.Module]:
    from omnistage.models.qwen2 import Qwen2Model
    from omnistage.models.voxtral_tts.backbone import backbone_config
    from omnistage.models.voxtral_tts.codec import VoxtralCodecDecoder
    from omnistage.models.voxtral_tts.config import read_params
    from omnistage.models.voxtral_tts.head import VoxtralAudioEmbedding, VoxtralFlowHead

    params, head, codec = read_params(folder)
    return {"backbone": on_meta(lambda: Qwen2Model(backbone_config(params))),
            "acoustic_transformer": on_meta(lambda: VoxtralFlowHead(head)),
            "mm_audio_embeddings.audio_codebook_embeddings.embeddings":
                on_meta(lambda: VoxtralAudioEmbedding(head, params["dim"])),
            "audio_tokenizer": on_meta(lambda: VoxtralCodecDecoder(codec))}


_MISTRAL = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
            "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
            "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
            "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm",
            "post_attention_layernorm": "ffn_norm"}


def _mistral_names(p: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The backbone's tensors as Mistral's consolidated file names them."""
    d, q, kv = p["dim"], p["n_heads"] * p["head_dim"], p["n_kv_heads"] * p["head_dim"]
    shapes = {"attention.wq": (q, d), "attention.wk": (kv, d), "attention.wv": (kv, d),
              "attention.wo": (d, q), "feed_forward.w1": (p["hidden_dim"], d),
              "feed_forward.w3": (p["hidden_dim"], d), "feed_forward.w2": (d, p["hidden_dim"]),
              "attention_norm": (d,), "ffn_norm": (d,)}
    yield "mm_audio_embeddings.tok_embeddings.weight", (p["vocab_size"], d)
    yield "norm.weight", (d,)
    for i in range(p["n_layers"]):
        for name, shape in shapes.items():
            yield f"layers.{i}.{name}.weight", shape


def build_voxtral(folder: Path, seed: int, device: torch.device) -> Path:
    from safetensors.torch import save_file

    from omnistage.models.voxtral_tts.config import END_AUDIO
    from tests.helpers.voxtral_tts import FIXTURES

    params = write_voxtral_params(folder)
    state = {n: seeded_tensor(n, s, len(s) == 1, seed, device).to(torch.bfloat16).cpu()
             for n, s in _mistral_names(params)}
    for prefix, model in voxtral_models(folder).items():
        if prefix != "backbone":
            state.update((f"{prefix}.{n}", t) for n, t in
                         random_state(model, seed, device, torch.bfloat16))
    force_voxtral(state)
    save_file(state, str(folder / "consolidated.safetensors"))
    (folder / "tekken.json").write_bytes((FIXTURES / "tekken" / "tekken.json").read_bytes())
    voices = json.loads((folder / "tekken.json").read_text())["audio"]["voice_num_audio_tokens"]
    (folder / "voice_embedding").mkdir(exist_ok=True)
    for k, (name, n) in enumerate(voices.items()):
        rows = torch.randn(n, params["dim"], generator=torch.Generator().manual_seed(100 + k))
        torch.save(rows / params["dim"] ** 0.5, folder / "voice_embedding" / f"{name}.pt")
    assert END_AUDIO == 1
    return folder


def force_voxtral(state: dict[str, Tensor]) -> None:
    """The semantic output's [END_AUDIO] row zeroed: its logit 0 never tops 8192 random ones."""
    from omnistage.models.voxtral_tts.config import END_AUDIO

    state["acoustic_transformer.semantic_codebook_output.weight"][END_AUDIO] = 0


# ---- MiMo-Audio ----------------------------------------------------------------------------

def mimo_models(folder: Path) -> dict[str, nn.Module]:
    from omnistage.models.mimo_audio.config import MiMoAudioConfig
    from omnistage.models.mimo_audio.model import MiMoAudioForCausalLM
    from omnistage.models.mimo_audio.tokenizer_decoder import (MiMoAudioTokenizerDecoder,
                                                               tokenizer_config)
    from omnistage.models.mimo_audio.tokenizer_encoder import MiMoAudioTokenizerEncoder

    cfg = MiMoAudioConfig.from_folder(folder, empty_idx=0)
    tok = tokenizer_config(folder / "audio_tokenizer")
    return {"llm": on_meta(lambda: MiMoAudioForCausalLM(cfg)),
            "encoder": on_meta(lambda: MiMoAudioTokenizerEncoder(tok)),
            "decoder": on_meta(lambda: MiMoAudioTokenizerDecoder(tok))}


def write_mimo_configs(folder: Path) -> int:
    """config.json and audio_tokenizer/config.json at the release's sizes, and the tiny text
    tokenizer with MiMo-Audio's specials; -> <|empty|>'s id."""
    _helpers()
    from tests.helpers.mimo_audio import FIXTURES, build_tiny_text_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_text_tokenizer(folder)
    cfg = json.loads((FIXTURES / "tiny" / "config.json").read_text())
    cfg.update(MIMO_LLM, torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "audio_tokenizer").mkdir(exist_ok=True)
    (folder / "audio_tokenizer" / "config.json").write_text(json.dumps(MIMO_TOKENIZER))
    return tok.convert_tokens_to_ids("<|empty|>")


def build_mimo(folder: Path, seed: int, device: torch.device) -> Path:
    from safetensors.torch import save_file

    empty = write_mimo_configs(folder)
    models = mimo_models(folder)
    llm = dict(unfused(random_state(models["llm"], seed, device, torch.bfloat16),
                       models["llm"]))
    force_mimo(llm, json.loads((folder / "config.json").read_text()), empty)
    save_file(llm, str(folder / "model.safetensors"))
    del llm
    tok: dict[str, Tensor] = {}
    for part in ("encoder", "decoder"):
        model = models[part]
        tok.update((type(model)._source_name(n), t) for n, t in
                   random_state(model, seed, device, torch.bfloat16))
    save_file(tok, str(folder / "audio_tokenizer" / "model.safetensors"))
    return folder


def force_mimo(state: dict[str, Tensor], cfg: dict, empty: int, bias: float = 200.0) -> None:
    """A value bias in the last layer adds o_proj @ bias (a constant: attention weights sum
    to 1) to every final hidden state; <|empty|>'s lm_head row reads its direction after the
    final norm, ten times the other rows' scale (tests/helpers/mimo_audio.py's change, larger)."""
    last = cfg["num_hidden_layers"] - 1
    attn = f"model.layers.{last}.self_attn"
    v = state[f"{attn}.v_proj.bias"].float() + bias
    state[f"{attn}.v_proj.bias"] = v.to(torch.bfloat16)
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    v = v.view(kvh, -1).repeat_interleave(heads // kvh, 0).reshape(-1)
    d = (state[f"{attn}.o_proj.weight"].float() @ v) * state["model.norm.weight"].float()
    lm = state["lm_head.weight"]
    lm[empty] = (10.0 * d / d.norm() * lm.float().norm(dim=1).mean()).to(lm.dtype)


# ---- the builder --------------------------------------------------------------------------

def build(family: str, tiny: bool, folder: Path, seed: int, device: torch.device) -> Path:
    """The family's servable folder (tiny: the tests' builders, plus the forcing change)."""
    assert family in FAMILIES, family
    _helpers()
    if family == "cosyvoice3":
        missing = [m for m in ("onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
        if missing:   # the front end's two files are exported (onnx) and run (onnxruntime)
            raise RuntimeError(f"bench speech --family cosyvoice3 needs {' and '.join(missing)} "
                               "(pip install onnx onnxruntime; wheels: flatbuffers, protobuf, "
                               "ml_dtypes too)")
    if not tiny:
        return {"cosyvoice3": build_cosyvoice3, "voxtral-tts": build_voxtral,
                "mimo-audio": build_mimo}[family](folder, seed, device)
    if family == "cosyvoice3":
        from tests.helpers.cosyvoice3 import write_served
        return write_served(folder)              # its stop rows are zeroed already
    if family == "mimo-audio":
        from tests.helpers.mimo_audio import build_tiny_mimo_audio
        return build_tiny_mimo_audio(folder, speech_bias=10.0)
    from safetensors.torch import load_file, save_file

    from tests.helpers.voxtral_tts import build_folder
    build_folder(folder, seed)
    file = folder / "consolidated.safetensors"
    state = load_file(file)
    force_voxtral(state)
    save_file(state, str(file))
    return folder
