"""Voxtral-TTS's backbone (a Mistral decoder from the release's consolidated.safetensors, on our
Qwen2Model) golden against transformers' MistralForCausalLM: a tiny seeded transformers model,
written into tmp_path in Mistral's consolidated layout (wq / wk back in Meta's interleaved
rotary rows, Mistral names, the text table as mm_audio_embeddings.tok_embeddings), loaded by our
loader; the final hidden states of two prompts (odd lengths) match."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from omnistage.models.mimo_audio.model import dense_forward
from omnistage.models.voxtral_tts.backbone import load_backbone

transformers = pytest.importorskip("transformers")
TINY = Path(__file__).resolve().parents[2] / "fixtures" / "voxtral_tts" / "tiny"
H, HKV, D = 4, 2, 8


def _meta_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' halves -> Meta's interleaved rotary rows (what consolidated files hold)."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple:
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=H,
                                     num_key_value_heads=HKV, head_dim=D, rms_norm_eps=1e-5,
                                     rope_theta=1e6, tie_word_embeddings=True,
                                     max_position_embeddings=128)
    torch.manual_seed(0)
    ref = transformers.MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.3) + (p.dim() == 1))
    names = {"q_proj": "attention.wq", "k_proj": "attention.wk", "v_proj": "attention.wv",
             "o_proj": "attention.wo", "gate_proj": "feed_forward.w1",
             "up_proj": "feed_forward.w3", "down_proj": "feed_forward.w2",
             "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
    out = {"mm_audio_embeddings.tok_embeddings.weight": ref.model.embed_tokens.weight,
           "norm.weight": ref.model.norm.weight}
    for i, layer in enumerate(ref.model.layers):
        for mod_name, mod in [*layer.self_attn.named_children(), *layer.mlp.named_children(),
                              ("input_layernorm", layer.input_layernorm),
                              ("post_attention_layernorm", layer.post_attention_layernorm)]:
            if mod_name not in names:
                continue
            w = mod.weight.detach()
            w = _meta_rows(w, H) if mod_name == "q_proj" else \
                _meta_rows(w, HKV) if mod_name == "k_proj" else w
            out[f"layers.{i}.{names[mod_name]}.weight"] = w
    folder = tmp_path_factory.mktemp("voxtral")
    save_file({k: v.contiguous() for k, v in out.items()}, folder / "consolidated.safetensors")
    params = json.loads((TINY / "params.json").read_text())
    params.update(dim=32, n_layers=2, head_dim=D, hidden_dim=48, n_heads=H, n_kv_heads=HKV,
                  norm_eps=1e-5, vocab_size=64, rope_theta=1e6, tied_embeddings=True)
    (folder / "params.json").write_text(json.dumps(params))
    return ref, load_backbone(folder), folder


def _ours(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return dense_forward(model, model.embed_tokens(ids.flatten()).view(*ids.shape, -1))


def test_hidden_states_match_transformers(pair: tuple) -> None:
    ref, ours, _ = pair
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids, output_hidden_states=True).hidden_states[-1]
    assert want.std() > 0.5
    torch.testing.assert_close(_ours(ours, ids), want, atol=1e-4, rtol=1e-4)


def test_without_the_rotary_permutation_it_fails(pair: tuple, monkeypatch) -> None:
    ref, _, folder = pair
    import omnistage.models.voxtral_tts.backbone as bb
    monkeypatch.setattr(bb, "unpermute", lambda w, n: w)
    wrong = bb.load_backbone(folder)
    ids = torch.arange(7)[None]
    with torch.no_grad():
        want = ref(ids, output_hidden_states=True).hidden_states[-1]
    assert (_ours(wrong, ids) - want).abs().max() > 1e-2


def test_a_missing_tensor_is_named(pair: tuple, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    _, _, folder = pair
    raw = load_file(folder / "consolidated.safetensors")
    del raw["layers.1.feed_forward.w2.weight"]
    save_file(raw, tmp_path / "consolidated.safetensors")
    (tmp_path / "params.json").write_text((folder / "params.json").read_text())
    with pytest.raises(ValueError, match="down_proj"):
        load_backbone(tmp_path)
