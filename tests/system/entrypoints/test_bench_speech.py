"""`omnistage bench speech --tiny` on the CPU for CosyVoice3, Voxtral-TTS and MiMo-Audio: each
family's served graph on the tests' tiny folder at concurrency 1 and 2, a well-formed JSON with
the issue's headline names, every request exactly the forced length of audio, first audio
within end to end. Plus the released-shape builders checked without allocating them: the
configs give the released parameter counts and every tensor the builder writes is one the
family's loader takes, at its shape; MiMo-Audio's forcing change making greedy decoding speak
at every step (and not without it); and the released-shape path of each family, its sizes
shrunk, served end to end at the released codecs' rates."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from omnistage.benchmarks import speech_checkpoint as sc
from omnistage.entrypoints.cli.main import main

# seconds of audio a request of `steps` speaking steps gives on the tiny folders
AUDIO_S = {"cosyvoice3": lambda n: n * 2 * 480 / 24000,     # 2 mel frames a token, hop 480
           "voxtral-tts": lambda n: (n - 1) * 64 / 24000,   # the last step's frame is dropped
           "mimo-audio": lambda n: n * 4 / 25}              # 4 frames a patch, 25 a second


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("family", sc.FAMILIES)
def test_bench_speech_tiny(tmp_path: Path, family: str) -> None:
    if family == "cosyvoice3":          # its front end's two ONNX files
        pytest.importorskip("onnx")
        pytest.importorskip("onnxruntime")
    rc = main(["bench", "speech", "--family", family, "--tiny", "--device", "cpu",
               "--concurrency", "1,2", "--c1-requests", "2", "--length", "6",
               "--out-dir", str(tmp_path), "--name", "speech"])
    assert rc == 0
    doc = json.loads((tmp_path / "speech.json").read_text())      # strict JSON
    assert doc["benchmark"] == "speech" and doc["family"] == family
    assert doc["device"] == "cpu" and doc["peak_device_memory_gb"] is None
    assert doc["config"]["steps"] == 6 and doc["config"]["backend"] == "inproc"
    k = family.replace("-", "_")
    want = AUDIO_S[family](6)
    rows = doc["omnistage"]["by_concurrency"]
    assert set(rows) == {"1", "2"}
    for c, row in rows.items():
        assert row["requests"] == 2 and row["requests_without_audio"] == 0
        assert row["audio_s"] == pytest.approx([want] * row["requests"])
        first, e2e, rtf = row["first_audio_s"], row["e2e_s"], row["rtf"]
        assert positive(first["median"]) and first["median"] <= e2e["median"]
        assert first["p90"] <= e2e["p90"] and first["median"] <= first["p90"]
        assert rtf["median"] == pytest.approx(e2e["median"] / want)
        assert row["audio_s_per_s"] == pytest.approx(sum(row["audio_s"]) / row["makespan_s"])
        assert row["makespan_s"] >= e2e["median"]
    ratios = doc["ratios"]
    assert set(ratios) == {f"{k}_rtf_c1", f"{k}_first_audio_s_c1", f"{k}_first_audio_c8_over_c1",
                           f"{k}_e2e_speedup_vs_reference", f"{k}_rtf_c2",
                           f"{k}_audio_s_per_s_c1", f"{k}_audio_s_per_s_c2",
                           f"{k}_first_audio_c2_over_c1"}
    assert ratios[f"{k}_rtf_c1"] == rows["1"]["rtf"]["median"]
    assert ratios[f"{k}_first_audio_s_c1"] == rows["1"]["first_audio_s"]["median"]
    assert ratios[f"{k}_first_audio_c2_over_c1"] == pytest.approx(
        rows["2"]["first_audio_s"]["median"] / rows["1"]["first_audio_s"]["median"])
    assert ratios[f"{k}_first_audio_c8_over_c1"] is None        # c = 8 not run
    assert ratios[f"{k}_e2e_speedup_vs_reference"] is None and doc["reference"] is None
    assert "not installable" in doc["notes"]


def _counts(models: dict[str, torch.nn.Module]) -> dict[str, float]:
    return {k: sc.count_parameters(m) / 1e9 for k, m in models.items()}


def test_released_shapes_have_the_released_sizes(tmp_path: Path) -> None:
    """On the meta device: Voxtral-TTS's groups as docs/models/voxtral-tts.md lists the
    release's (3.03 B layers, 0.43 B embeddings, 0.39 B head, 0.15 B codec), MiMo-Audio's
    LLM a Qwen2-7B (7.6 B) with its 16- and 6-layer local transformers and a 1.3 B tokenizer,
    CosyVoice3's LM a Qwen2.5-0.5B with its speech tables; and the backbone the Voxtral
    builder writes under Mistral's names loads into every parameter at its shape."""
    from omnistage.models.qwen2 import Qwen2ForCausalLM
    from omnistage.models.voxtral_tts.backbone import _load, backbone_config, our_names

    params = sc.write_voxtral_params(tmp_path / "v")
    vox = sc.voxtral_models(tmp_path / "v")
    n = _counts(vox)
    embed = params["vocab_size"] * params["dim"] / 1e9
    assert n["backbone"] - embed == pytest.approx(3.03, abs=0.01)
    assert embed + n["mm_audio_embeddings.audio_codebook_embeddings.embeddings"] == \
        pytest.approx(0.43, abs=0.005)
    assert n["acoustic_transformer"] == pytest.approx(0.39, abs=0.01)
    assert n["audio_tokenizer"] == pytest.approx(0.15, abs=0.01)
    assert sum(n.values()) == pytest.approx(4.0, abs=0.05)
    cfg = backbone_config(params)
    with torch.device("meta"):
        raw = {name: torch.empty(shape) for name, shape in sc._mistral_names(params)}
    loaded = _load(vox["backbone"], our_names(raw, cfg))
    assert loaded == {p for p, _ in vox["backbone"].named_parameters()}
    assert Qwen2ForCausalLM.packed_modules                      # the loader fused q/k/v

    sc.write_mimo_configs(tmp_path / "m")
    mimo = sc.mimo_models(tmp_path / "m")
    llm = mimo["llm"]
    assert sc.count_parameters(llm.model) / 1e9 + 151680 * 4096 / 1e9 == \
        pytest.approx(7.62, abs=0.02)                          # + lm_head: Qwen2-7B's size
    assert sc.count_parameters(llm.local_transformer) / 1e9 == pytest.approx(0.27, abs=0.01)
    assert sc.count_parameters(llm.input_local_transformer) / 1e9 == pytest.approx(0.10, abs=0.01)
    tok = _counts({k: mimo[k] for k in ("encoder", "decoder")})
    assert sum(tok.values()) == pytest.approx(1.3, abs=0.05)

    sc.write_cosyvoice3_config(tmp_path / "c")
    cv = _counts(sc.cosyvoice3_models(tmp_path / "c"))
    assert cv["llm"] == pytest.approx(0.494 + 2 * 6761 * 896 / 1e9, abs=0.002)
    assert cv["flow"] == pytest.approx(0.33, abs=0.01) and cv["hift"] == pytest.approx(0.021,
                                                                                       abs=0.002)


def test_mimo_builder_forces_speech(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The released-shape MiMo-Audio builder, run at a small size on the CPU: the folder loads
    through the family's loaders, and greedy decoding draws <|empty|> (speech) at every
    position of random prompts."""
    from transformers import AutoTokenizer

    from omnistage.models.mimo_audio.model import MiMoAudioForCausalLM, dense_forward
    from omnistage.models.mimo_audio.prompt import text_patches
    from omnistage.models.mimo_audio.tokenizer_decoder import MiMoAudioTokenizerDecoder

    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=512,
                 local_dim=32, local_layers=1, local_attn_heads=2, local_ffn_dim=64,
                 input_local_dim=32, input_local_layers=1)
    tok = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
               decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=64,
               vocoder_dim=16, vocoder_attention_heads=2, vocoder_intermediate_dim=32,
               vocoder_num_layers=1)
    monkeypatch.setattr(sc, "MIMO_LLM", {**sc.MIMO_LLM, **small})
    monkeypatch.setattr(sc, "MIMO_TOKENIZER", {**sc.MIMO_TOKENIZER, **tok})
    def argmax_is_empty(folder: Path) -> torch.Tensor:
        empty = AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids("<|empty|>")
        model = MiMoAudioForCausalLM.from_pretrained(folder, empty, "cpu", torch.float32)
        gen, hits = torch.Generator().manual_seed(1), []
        for _ in range(4):
            ids = torch.randint(0, 300, (9,), generator=gen).tolist()
            with torch.no_grad():
                rows = model.patch_embeds(text_patches(ids, model.cfg))[None]
                hits.append(model.compute_logits(dense_forward(model.model, rows)[0])
                            .argmax(-1) == empty)
        return torch.cat(hits)

    folder = sc.build("mimo-audio", False, tmp_path / "m", 0, torch.device("cpu"))
    MiMoAudioTokenizerDecoder.from_pretrained(folder / "audio_tokenizer")
    assert argmax_is_empty(folder).all()
    monkeypatch.setattr(sc, "force_mimo", lambda *args: None)      # the control: unforced
    assert not argmax_is_empty(sc.build("mimo-audio", False, tmp_path / "u", 0,
                                        torch.device("cpu"))).all()


SMALL = {  # the released-shape builders' dicts, shrunk so the CPU serves them in seconds
    "cosyvoice3": {"COSYVOICE3_QWEN2": dict(num_hidden_layers=1),
                   "COSYVOICE3_FLOW": dict(depth=1, dim=256, heads=4, la_channels=256,
                                           base_channels=64, f0_channels=64)},
    "voxtral-tts": {"VOXTRAL_BACKBONE": dict(dim=64, n_layers=1, head_dim=16, hidden_dim=128,
                                             n_heads=4, n_kv_heads=2, vocab_size=4096),
                    "VOXTRAL_HEAD": dict(input_dim=64, dim=64, n_layers=1, head_dim=16,
                                         hidden_dim=128, n_heads=4, n_kv_heads=2),
                    "VOXTRAL_CODEC": dict(dim=64, hidden_dim=128, head_dim=16, n_heads=4,
                                          n_kv_heads=4)},
    "mimo-audio": {"MIMO_LLM": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=64, intermediate_size=512,
                                    vocab_size=1024, local_layers=1, input_local_layers=1),
                   "MIMO_TOKENIZER": dict(encoder_layers=1, decoder_layers=2,
                                          vocoder_num_layers=2)}}
# seconds of audio per request of n steps at the released codecs' rates
RELEASED_AUDIO_S = {"cosyvoice3": lambda n: n * 2 * 480 / 24000,
                    "voxtral-tts": lambda n: (n - 1) * 1920 / 24000,
                    "mimo-audio": lambda n: n * 4 * 960 / 24000}


@pytest.mark.parametrize("family", sc.FAMILIES)
def test_released_shape_builders_serve(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The released-shape path of `bench speech` (not --tiny) with its sizes shrunk: the
    folders the GPU run builds are served by the family's graph (in process, on the CPU),
    every request the forced length at the released codecs' rates (24 kHz; 1920 samples a
    Voxtral frame, 960 a MiMo-Audio frame, 480 a CosyVoice3 mel frame)."""
    from omnistage.benchmarks import speech

    if family == "cosyvoice3":
        pytest.importorskip("onnx")
        pytest.importorskip("onnxruntime")
    for name, small in SMALL[family].items():
        monkeypatch.setattr(sc, name, {**getattr(sc, name), **small})
    steps = 30 if family == "cosyvoice3" else 6
    doc = speech.run(speech.SpeechBenchConfig(family=family, length=steps, concurrency=(1, 2),
                                              c1_requests=1, device="cpu", backend="inproc"))
    for row in doc["omnistage"]["by_concurrency"].values():
        assert row["audio_s"] == pytest.approx([RELEASED_AUDIO_S[family](steps)]
                                               * row["requests"])
        assert row["first_audio_s"]["median"] <= row["e2e_s"]["median"]


def test_the_regress_probe_of_speech_runs_tiny() -> None:
    """`bench regress --probes speech` (the H200 baseline holds its figures) runs Voxtral-TTS
    and MiMo-Audio at the tiny size on the CPU and names each family's figures."""
    import math

    from omnistage.benchmarks import regress

    figures = regress.probe_speech("cpu", tiny=True)
    for family in ("voxtral_tts", "mimo_audio"):
        assert {f"{family}_{name}" for name in ("first_audio_s_c1", "first_audio_s_c8",
                                                "first_audio_c8_over_c1", "rtf_c1", "rtf_c8")
                } <= set(figures)
    for value, better in figures.values():
        assert better == regress.LOWER and math.isfinite(value) and value > 0
