"""Golden: our CLIP text, T5, UMT5 and Qwen text encoders against transformers on the same
tiny random checkpoints (float32, padded batches of different lengths, max abs error 1e-5), the
checkpoint layouts each one must accept, and loading that fails by name on missing,
unexpected or mis-shaped tensors; Wan's prompt embeddings against diffusers' WanPipeline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from diffusers import WanPipeline
from diffusers.pipelines.wan.pipeline_wan import prompt_clean as diffusers_prompt_clean
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection,
                          PreTrainedTokenizerBase,
                          Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Config,
                          Qwen2Model, Qwen3Config, Qwen3ForCausalLM, Qwen3Model, T5Config,
                          T5EncoderModel, T5ForConditionalGeneration, UMT5Config,
                          UMT5EncoderModel)
from transformers.models.t5.modeling_t5 import T5Attention as HFT5Attention

from omnistage.models.text_encoders import (CLIPTextEncoder, QwenTextEncoder, T5Encoder,
                                            UMT5Encoder, encode_wan_prompts)
from omnistage.models.text_encoders.t5 import relative_position_bucket
from omnistage.models.text_encoders.umt5 import prompt_clean
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer
from omnistage.testing.tiny_models import edit_checkpoint

TOL = 1e-5
VOCAB = 64
LENGTHS = [11, 6, 9]   # real tokens per row; rows are padded to S = 11


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """HF initialises norms to 1 and biases to 0, which would hide a swapped norm or a lost
    bias: draw everything, scaled so activations stay O(1)."""
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_(0.1 * torch.randn_like(p) + (0.0 if name.endswith("bias") else 1.0))
        elif "embed" in name or name.endswith(("shared.weight", "relative_attention_bias.weight")):
            p.copy_(torch.randn_like(p))
        else:
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return model.eval()


def save(model: nn.Module, path: Path, sharded: bool = False) -> Path:
    model.save_pretrained(path, max_shard_size="20KB" if sharded else "50GB")
    assert (path / "model.safetensors.index.json").is_file() == sharded
    return path


def padded_batch(lengths: list[int], pad_id: int, last_id: int | None = None, seed: int = 1
                 ) -> tuple[Tensor, Tensor]:
    """Right-padded ids (B, S) from [3, VOCAB-2), `last_id` ending each row, and the mask."""
    g = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    ids = torch.full((len(lengths), seq_len), pad_id)
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(3, VOCAB - 2, (n,), generator=g)
        if last_id is not None:
            ids[row, n - 1] = last_id
        mask[row, :n] = 1
    return ids, mask


def max_err(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# ---- CLIP ----------------------------------------------------------------------------------

def clip_config(eos_token_id: int, hidden_act: str) -> CLIPTextConfig:
    return CLIPTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16,
                          hidden_act=hidden_act, eos_token_id=eos_token_id, bos_token_id=VOCAB - 2,
                          pad_token_id=1)


@pytest.mark.parametrize("eos_token_id, hidden_act, pad_id, sharded", [
    (2, "quick_gelu", VOCAB - 1, False),   # legacy config (FLUX): eos is the largest id, pads too
    (5, "gelu", 1, True),                  # eos_token_id rule, eos id neither largest nor pad
], ids=["argmax-eos", "eos-token-id"])
def test_clip_matches_transformers(tmp_path: Path, eos_token_id: int, hidden_act: str,
                                   pad_id: int, sharded: bool) -> None:
    ref = randomize(CLIPTextModel(clip_config(eos_token_id, hidden_act)))
    save(ref, tmp_path, sharded)
    ours = CLIPTextEncoder.from_pretrained(tmp_path, "cpu", torch.float32)
    eos = VOCAB - 1 if eos_token_id == 2 else eos_token_id
    ids, mask = padded_batch(LENGTHS, pad_id, last_id=eos)
    with torch.no_grad():
        for m in (None, mask):   # FLUX passes no mask; causal attention makes both equal
            expected = ref(ids, attention_mask=m)
            hidden, pooled = ours(ids, m)
            assert max_err(hidden, expected.last_hidden_state) < TOL
            assert max_err(pooled, expected.pooler_output) < TOL
    assert ours.config.max_position_embeddings == 16


def test_clip_with_projection_matches_transformers(tmp_path: Path) -> None:
    """SD3's CLIP-L / CLIP-G: CLIPTextModelWithProjection, the penultimate hidden state and the
    projected pooled output (`text_embeds`), its own projection width."""
    config = clip_config(2, "gelu")
    config.projection_dim = 24
    ref = randomize(CLIPTextModelWithProjection(config))
    save(ref, tmp_path)
    ours = CLIPTextEncoder.from_pretrained(tmp_path, "cpu", torch.float32)
    ids, _ = padded_batch(LENGTHS, VOCAB - 1, last_id=VOCAB - 1)
    with torch.no_grad():
        expected = ref(ids, output_hidden_states=True)
        hidden, pooled = ours(ids, hidden_layer=-2)
        last, _ = ours(ids)
    assert pooled.shape == (len(LENGTHS), 24)
    assert max_err(pooled, expected.text_embeds) < TOL
    assert max_err(hidden, expected.hidden_states[-2]) < TOL
    assert max_err(last, expected.last_hidden_state) < TOL
    with pytest.raises(ValueError, match="hidden_layer=3: outside"):
        ours(ids, hidden_layer=3)


def test_clip_loads_prefixed_checkpoint(tmp_path: Path) -> None:
    """Checkpoints written before transformers 5 (FLUX's) name tensors "text_model.*" and may
    hold the position-ids buffer."""
    ref = randomize(CLIPTextModel(clip_config(2, "quick_gelu")))
    save(ref, tmp_path)
    weights = {f"text_model.{k}": v for k, v in load_file(tmp_path / "model.safetensors").items()}
    weights["text_model.embeddings.position_ids"] = torch.arange(16)[None]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = CLIPTextEncoder.from_pretrained(tmp_path)
    ids, _ = padded_batch(LENGTHS, VOCAB - 1, last_id=VOCAB - 1)
    with torch.no_grad():
        assert max_err(ours(ids)[1], ref(ids).pooler_output) < TOL


# ---- T5 ------------------------------------------------------------------------------------

def t5_config(feed_forward_proj: str) -> T5Config:
    # 8 buckets up to distance 12 with S = 20: exact, logarithmic and clamped buckets all occur
    return T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                    relative_attention_num_buckets=8, relative_attention_max_distance=12,
                    feed_forward_proj=feed_forward_proj, tie_word_embeddings=False)


T5_LENGTHS = [20, 13, 7]


@pytest.mark.parametrize("feed_forward_proj, sharded", [("gated-gelu", True), ("relu", False)],
                         ids=["v1.1-gated-gelu", "v1.0-relu"])
def test_t5_matches_transformers(tmp_path: Path, feed_forward_proj: str, sharded: bool) -> None:
    ref = randomize(T5EncoderModel(t5_config(feed_forward_proj)))
    save(ref, tmp_path, sharded)
    ours = T5Encoder.from_pretrained(tmp_path, "cpu", torch.float32)
    ids, mask = padded_batch(T5_LENGTHS, pad_id=0)
    with torch.no_grad():
        for m in (None, mask):
            expected = ref(ids, attention_mask=m).last_hidden_state
            assert max_err(ours(ids, m), expected) < TOL


def test_t5_relative_position_buckets() -> None:
    rel = torch.arange(-300, 301)[None, :]
    for num_buckets, max_distance in [(32, 128), (8, 12), (16, 40)]:   # (32, 128): T5-XXL
        expected = HFT5Attention._relative_position_bucket(
            rel, bidirectional=True, num_buckets=num_buckets, max_distance=max_distance)
        assert torch.equal(relative_position_bucket(rel, num_buckets, max_distance), expected)


def test_t5_loads_full_t5_checkpoint(tmp_path: Path) -> None:
    """A T5ForConditionalGeneration folder: the decoder and LM head are skipped, and
    `encoder.embed_tokens.weight` stands in for `shared.weight`."""
    full = randomize(T5ForConditionalGeneration(t5_config("gated-gelu")))
    save(full, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert any(k.startswith("decoder.") for k in weights)
    weights.setdefault("lm_head.weight", torch.zeros(VOCAB, 32))   # untied T5 v1.1 has one
    weights["encoder.embed_tokens.weight"] = weights.pop("shared.weight")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = T5Encoder.from_pretrained(tmp_path)
    ids, mask = padded_batch(T5_LENGTHS, pad_id=0)
    with torch.no_grad():
        expected = full.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        assert max_err(ours(ids, mask), expected) < TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["t5", "umt5"])
def test_t5_half_precision(tmp_path: Path, name: str, dtype: torch.dtype) -> None:
    """In float16 HF keeps `wo` in float32 (the residual stream turns float32) and clamps
    float16 streams; in bfloat16 (Wan's checkpoint) neither. Ours does the same, so it stays
    within half-precision rounding of HF's."""
    hf_cls, cls, config = {"t5": (T5EncoderModel, T5Encoder, t5_config("gated-gelu")),
                           "umt5": (UMT5EncoderModel, UMT5Encoder, umt5_config())}[name]
    save(randomize(hf_cls(config)), tmp_path)
    ref = hf_cls.from_pretrained(tmp_path, dtype=dtype).eval()
    ours = cls.from_pretrained(tmp_path, dtype=dtype)
    dense = ours.encoder.block[0].layer[1].DenseReluDense
    wo_dtype = torch.float32 if dtype == torch.float16 else dtype
    assert ref.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == wo_dtype
    assert dense.wo.weight.dtype == wo_dtype and dense.wi_01.weight.dtype == dtype
    ids, mask = padded_batch(T5_LENGTHS, pad_id=0)
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).last_hidden_state
        out = ours(ids, mask)
    assert out.dtype == expected.dtype == dtype
    assert max_err(out.float(), expected.float()) < 2e-2 * expected.abs().max().item()


# ---- UMT5 (Wan) ----------------------------------------------------------------------------

def umt5_config(vocab_size: int = VOCAB) -> UMT5Config:
    # T5's buckets; 4 layers, each with its own table (Wan's umt5-xxl: gated-gelu, gelu_new)
    return UMT5Config(vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=48, num_layers=4,
                      num_heads=4, relative_attention_num_buckets=8,
                      relative_attention_max_distance=12, feed_forward_proj="gated-gelu")


def test_umt5_matches_transformers(tmp_path: Path) -> None:
    ref = randomize(UMT5EncoderModel(umt5_config()))
    save(ref, tmp_path, sharded=True)
    ours = UMT5Encoder.from_pretrained(tmp_path, "cpu", torch.float32)
    assert ours.config.relative_bias_every_layer
    ids, mask = padded_batch(T5_LENGTHS, pad_id=0)
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).last_hidden_state
        assert expected.std() > 0.5   # O(1) outputs: TOL is a tight bound
        assert max_err(ours(ids, mask), expected) < TOL
        assert max_err(ours(ids), ref(ids).last_hidden_state) < TOL
        for row, n in enumerate(T5_LENGTHS):   # a prompt alone = its real tokens in the batch
            assert max_err(ours(ids[row:row + 1, :n])[0], expected[row, :n]) < TOL
        # T5's rule, block 0's bias in every block, is far off: each block's table counts here
        for block in ours.encoder.block[1:]:
            block.layer[0].SelfAttention.has_relative_attention_bias = False
        assert max_err(ours(ids, mask), expected) > 1e4 * TOL


WAN_PROMPTS = ["A  cat &amp;amp; a dog\n\t walking on the beach ",
               "Hello world",
               " ".join(["The quick brown fox jumps over the lazy dog."] * 3)]


@pytest.fixture(scope="module")
def wan_text(tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[PreTrainedTokenizerBase, nn.Module, UMT5Encoder]:
    """A Wan folder's tokenizer/ (the tiny one) and text_encoder/: HF's model and ours."""
    path = tmp_path_factory.mktemp("wan")
    tokenizer = build_tiny_tokenizer(path / "tokenizer")
    ref = randomize(UMT5EncoderModel(umt5_config(len(tokenizer))))
    save(ref, path / "text_encoder")
    return tokenizer, ref, UMT5Encoder.from_pretrained(path / "text_encoder")


@pytest.mark.parametrize("max_sequence_length", [512, 32], ids=["wan-default", "truncating"])
def test_wan_prompt_embeds_match_diffusers(wan_text: tuple, max_sequence_length: int) -> None:
    tokenizer, ref, ours = wan_text
    cleaned = [prompt_clean(p) for p in WAN_PROMPTS]
    assert cleaned == [diffusers_prompt_clean(p) for p in WAN_PROMPTS]
    assert cleaned[0] == "A cat & a dog walking on the beach"
    num_tokens = [min(len(ids), max_sequence_length) for ids in tokenizer(cleaned).input_ids]
    assert len(set(num_tokens)) == 3 and min(num_tokens) < max_sequence_length

    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=ref, vae=None, scheduler=None)
    with torch.no_grad():
        expected = pipe._get_t5_prompt_embeds(WAN_PROMPTS, max_sequence_length=max_sequence_length,
                                              device=torch.device("cpu"))
    out = encode_wan_prompts(ours, tokenizer, WAN_PROMPTS, max_sequence_length)
    assert out.shape == (3, max_sequence_length, 32)
    assert expected[0, :num_tokens[0]].std() > 0.5
    assert max_err(out, expected) < TOL
    for row, n in enumerate(num_tokens):   # zeros exactly past the prompt's tokens
        assert out[row, :n].abs().amax(dim=-1).min() > 0.1 and not out[row, n:].any()


def test_wan_prompts_batched_equal_each_alone(wan_text: tuple) -> None:
    tokenizer, _, ours = wan_text
    batched = encode_wan_prompts(ours, tokenizer, WAN_PROMPTS, 32)
    for row, prompt in enumerate(WAN_PROMPTS):
        alone = encode_wan_prompts(ours, tokenizer, [prompt], 32)
        assert max_err(alone[0], batched[row]) < TOL
    with pytest.raises(ValueError, match="max_sequence_length=0: must be at least 1"):
        encode_wan_prompts(ours, tokenizer, WAN_PROMPTS, 0)


# ---- Qwen ----------------------------------------------------------------------------------

QWEN_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                 max_position_embeddings=64, pad_token_id=0, bos_token_id=None, eos_token_id=1)


def qwen3_model() -> nn.Module:
    return Qwen3Model(Qwen3Config(**QWEN_TEXT, head_dim=8))


def qwen3_causal_lm() -> nn.Module:
    return Qwen3ForCausalLM(Qwen3Config(**QWEN_TEXT, head_dim=16, tie_word_embeddings=False))


def qwen2_model() -> nn.Module:
    return Qwen2Model(Qwen2Config(**QWEN_TEXT))


def qwen2_5_vl() -> nn.Module:
    text = dict(QWEN_TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                  out_hidden_size=32, fullatt_block_indexes=[0])
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(text_config=text, vision_config=vision))


def mistral3() -> nn.Module:
    """FLUX.2-dev's text encoder: a Mistral decoder (no biases, no qk-norm) inside Mistral-3."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    text = dict(QWEN_TEXT, model_type="mistral", head_dim=16, rope_theta=1e9,
                sliding_window=None)
    vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8,
                  head_dim=8)
    return Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=text, vision_config=vision, spatial_merge_size=2,
        image_token_index=VOCAB - 1))


QWEN_MODELS = {"qwen3-model": qwen3_model, "qwen3-causal-lm": qwen3_causal_lm,
               "qwen2-model": qwen2_model, "qwen2.5-vl": qwen2_5_vl, "mistral3": mistral3}


def hf_hidden_states(ref: nn.Module, ids: Tensor, mask: Tensor) -> tuple[Tensor, ...]:
    with torch.no_grad():   # the call diffusers' Z-Image / Qwen-Image pipelines make
        return ref(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("name", list(QWEN_MODELS))
def test_qwen_matches_transformers(tmp_path: Path, name: str) -> None:
    ref = randomize(QWEN_MODELS[name]())
    save(ref, tmp_path, sharded=name == "qwen3-causal-lm")
    ours = QwenTextEncoder.from_pretrained(tmp_path, "cpu", torch.float32)
    ids, mask = padded_batch(LENGTHS, pad_id=0)
    expected = hf_hidden_states(ref, ids, mask)
    assert len(expected) == 4   # embeddings + 3 layers, the last one after the final norm
    with torch.no_grad():
        out = ours(ids, mask, output_layers=(0, 1, -2, -1))
    for layer in (0, 1, -2, -1):   # every position, padding included
        assert max_err(out[layer], expected[layer]) < TOL, layer
    assert set(out) == {0, 1, -2, -1}


def test_qwen2_5_vl_flat_legacy_config(tmp_path: Path) -> None:
    """Qwen-Image's text_encoder/config.json predates transformers 5: the text fields sit at
    the top level with `rope_scaling` {"mrope_section", "type"} and `rope_theta`."""
    ref = randomize(qwen2_5_vl())
    save(ref, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    del text["model_type"], config["dtype"]
    config.update(text, torch_dtype="float32", transformers_version="4.53.1",
                  rope_theta=rope["rope_theta"], sliding_window=32768, use_sliding_window=False,
                  rope_scaling={"mrope_section": rope["mrope_section"], "rope_type": "default",
                                "type": "default"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = QwenTextEncoder.from_pretrained(tmp_path)
    assert ours.config.num_hidden_layers == 3 and ours.config.qkv_bias
    ids, mask = padded_batch(LENGTHS, pad_id=0)
    expected = hf_hidden_states(ref, ids, mask)
    with torch.no_grad():
        assert max_err(ours(ids, mask)[-1], expected[-1]) < TOL


def test_qwen_left_padding_and_no_mask(tmp_path: Path) -> None:
    ref = randomize(qwen3_model())
    save(ref, tmp_path)
    ours = QwenTextEncoder.from_pretrained(tmp_path)
    ids, mask = padded_batch(LENGTHS, pad_id=0)
    ids, mask = ids.flip(1), mask.flip(1)
    expected = hf_hidden_states(ref, ids, mask)
    with torch.no_grad():
        assert max_err(ours(ids, mask, output_layers=(-2,))[-2], expected[-2]) < TOL
        no_mask = ref(input_ids=ids, output_hidden_states=True).hidden_states
        assert max_err(ours(ids, None)[-1], no_mask[-1]) < TOL


def test_qwen_stops_after_deepest_requested_layer(tmp_path: Path) -> None:
    save(randomize(qwen3_model()), tmp_path)
    ours = QwenTextEncoder.from_pretrained(tmp_path)
    calls: list[str] = []
    for name, module in [("first", ours.layers[0]), ("last", ours.layers[-1]),
                         ("norm", ours.norm)]:
        module.register_forward_hook(lambda *_, name=name: calls.append(name))
    ids, mask = padded_batch(LENGTHS, pad_id=0)
    with torch.no_grad():
        ours(ids, mask, output_layers=(-2,))
        assert calls == ["first"]   # hidden_states[-2] = output of layer 2 of 3: no layer 3
        calls.clear()
        ours(ids, mask, output_layers=(-1,))
        assert calls == ["first", "last", "norm"]
        with pytest.raises(ValueError, match="output_layers: -5 is outside"):
            ours(ids, mask, output_layers=(-5,))


# ---- strict loading ------------------------------------------------------------------------

ENCODERS = {
    "clip": (lambda: CLIPTextModel(clip_config(2, "quick_gelu")), CLIPTextEncoder,
             "encoder.layers.1.self_attn.k_proj.weight",
             "encoder.layers.1.self_attn.k_proj.weight"),
    "t5": (lambda: T5EncoderModel(t5_config("gated-gelu")), T5Encoder,
           "encoder.block.1.layer.1.DenseReluDense.wi_1.weight",
           "encoder.block.1.layer.1.DenseReluDense.wi_1.weight"),
    "umt5": (lambda: UMT5EncoderModel(umt5_config()), UMT5Encoder,
             "encoder.block.2.layer.0.SelfAttention.relative_attention_bias.weight",
             "encoder.block.2.layer.0.SelfAttention.relative_attention_bias.weight"),
    "qwen2.5-vl": (qwen2_5_vl, QwenTextEncoder, "model.layers.2.mlp.up_proj.weight",
                   "layers.2.mlp.up_proj.weight"),
}


@pytest.mark.parametrize("name", list(ENCODERS))
def test_strict_loading_names_bad_tensors(tmp_path: Path, name: str) -> None:
    build_ref, cls, stored, ours_name = ENCODERS[name]
    save(build_ref(), tmp_path)
    original = load_file(tmp_path / "model.safetensors")

    edit_checkpoint(tmp_path, lambda w: w.pop(stored))
    with pytest.raises(ValueError, match=rf"missing tensors: {ours_name}"):
        cls.from_pretrained(tmp_path)

    def add_unexpected(w: dict[str, Tensor]) -> None:
        w.update(original)
        w["model.vision_extra.weight"] = torch.zeros(2)   # near an ignored name, not one
    edit_checkpoint(tmp_path, add_unexpected)
    with pytest.raises(ValueError, match=r"unexpected tensors .*vision_extra\.weight"):
        cls.from_pretrained(tmp_path)

    def misshape(w: dict[str, Tensor]) -> None:
        w.clear()
        w.update(original)
        w[stored] = w[stored][:, :-1].contiguous()
    edit_checkpoint(tmp_path, misshape)
    with pytest.raises(ValueError, match=rf"'{ours_name}': expected shape"):
        cls.from_pretrained(tmp_path)


def test_wrong_model_type_is_refused(tmp_path: Path) -> None:
    save(CLIPTextModel(clip_config(2, "quick_gelu")), tmp_path)
    with pytest.raises(ValueError, match="model_type 'clip_text_model': not a supported Qwen"):
        QwenTextEncoder.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a T5 model"):
        T5Encoder.from_pretrained(tmp_path)


def test_t5_and_umt5_checkpoints_are_not_interchangeable(tmp_path: Path) -> None:
    """Same tensor names but for the tables: each encoder refuses the other's model_type."""
    save(T5EncoderModel(t5_config("gated-gelu")), tmp_path / "t5")
    save(UMT5EncoderModel(umt5_config()), tmp_path / "umt5")
    with pytest.raises(ValueError, match=r"model_type 't5': .*\(expected umt5\)"):
        UMT5Encoder.from_pretrained(tmp_path / "t5")
    with pytest.raises(ValueError, match=r"model_type 'umt5': .*\(expected t5 or mt5\)"):
        T5Encoder.from_pretrained(tmp_path / "umt5")
