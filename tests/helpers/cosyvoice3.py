"""The tiny CosyVoice3 of tests/fixtures/cosyvoice3 (scripts/cosyvoice3_fixtures.py made it with
the upstream classes) laid out as a released checkpoint folder: flow.pt and hift.pt as saved,
and a cosyvoice3.yaml written in the released file's HyperPyYAML form (tags, `!ref`s) from the
manifest's configs, so our loader reads what it would read from the Hub."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent.parent / "fixtures" / "cosyvoice3"

YAML = """\
__set_seed1: !apply:random.seed [1986]
sample_rate: {sr}
spk_embed_dim: {spk}
token_frame_rate: 25
token_mel_ratio: {ratio}
chunk_size: {chunk_tokens}
num_decoding_left_chunks: -1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: {mel}
    output_size: {mel}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {vocab}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: {lookahead}
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: {mel}
        channels: {la_channels}
        pre_lookahead_len: {lookahead}
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: {mel}
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: {cfg_rate}
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {dim}
            depth: {depth}
            heads: {heads}
            dim_head: {dim_head}
            ff_mult: {ff_mult}
            mel_dim: {mel}
            mu_dim: {mel}
            spk_dim: {mel}
            out_channels: {mel}
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: {mel}
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
{hift}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: {mel}
        cond_channels: {f0_channels}
"""


def manifest() -> dict:
    return json.loads((FIXTURES / "manifest.json").read_text())


def expected() -> dict[str, torch.Tensor]:
    return torch.load(FIXTURES / "expected.pt", map_location="cpu", weights_only=True)


def write_checkpoint(folder: Path) -> Path:
    m = manifest()
    f, d, h = m["flow"], m["dit"], dict(m["hift"])
    assert d["static_chunk_size"] % f["token_mel_ratio"] == 0, d
    hift = "\n".join(f"    {k}: {json.dumps(v)}" for k, v in h.items()
                     if k != "sampling_rate") + "\n    sampling_rate: !ref <sample_rate>"
    text = YAML.format(sr=h["sampling_rate"], spk=f["spk_embed_dim"], ratio=f["token_mel_ratio"],
                       chunk_tokens=d["static_chunk_size"] // f["token_mel_ratio"],
                       mel=f["input_size"], vocab=f["vocab_size"],
                       lookahead=f["pre_lookahead_len"], la_channels=f["lookahead_channels"],
                       cfg_rate=m["cfm"]["inference_cfg_rate"], dim=d["dim"], depth=d["depth"],
                       heads=d["heads"], dim_head=d["dim_head"], ff_mult=d["ff_mult"], hift=hift,
                       f0_channels=m["f0_predictor"]["cond_channels"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cosyvoice3.yaml").write_text(text)
    for name in ("flow.pt", "hift.pt"):
        shutil.copy(FIXTURES / name, folder / name)
    return folder


def seeded_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """scripts/cosyvoice3_fixtures.py's rule, drawn in sorted-name order."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * x if name.endswith(("weight", "alpha")) else 0.05 * x
    fan_in = 1
    for d in shape[1:]:
        fan_in *= d
    return x / fan_in ** 0.5


def write_llm(folder: Path) -> Path:
    """llm.pt redrawn from the manifest's seed and tensor list (the fixtures zeroed the speech
    decoder's stop rows; so does this), and CosyVoice-BlankEN/config.json."""
    m = manifest()
    gen = torch.Generator().manual_seed(m["llm_seed"])
    state = {n: seeded_value(n, tuple(s), gen) for n, s in sorted(m["llm_tensors"])}
    state["llm_decoder.weight"][m["llm"]["speech_token_size"]:] = 0
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "llm.pt")
    (folder / "CosyVoice-BlankEN").mkdir(exist_ok=True)
    (folder / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(m["qwen2"]))
    return folder


QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")   # 151643.. as Qwen2's


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE (omnistage.testing.tiny_tokenizer's merges) padded with unreachable
    fillers to Qwen2's 151643 ids, its three specials after them, so CosyVoice3's added
    `<|endofprompt|>` is 151646 as on the released vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from omnistage.testing.tiny_tokenizer import _train

    trained = json.loads(_train().to_str())["model"]
    vocab = {t: i for t, i in trained["vocab"].items() if t not in QWEN_SPECIALS}
    vocab = {t: k for k, t in enumerate(sorted(vocab, key=vocab.__getitem__))}
    vocab.update({f"<filler{k}>": k for k in range(len(vocab), 151643)})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(QWEN_SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(folder / "CosyVoice-BlankEN"))


class _SpeechTokenizer(torch.nn.Module):
    """speech_tokenizer_v3.onnx's signature: feats (1, 128, T), feats_length (1,) -> tokens
    at a quarter of the frame rate (ids below the tiny flow's 61)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(128, 40, 4, stride=4)

    def forward(self, feats, feats_length):
        return self.conv(feats).argmax(dim=1).to(torch.int32) + feats_length[:, None] * 0


class _Speaker(torch.nn.Module):
    """campplus.onnx's signature: (1, T, 80) -> (1, spk_embed_dim)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(80, dim)

    def forward(self, x):
        return self.proj(torch.tanh(x)).mean(dim=1)


def write_onnx(folder: Path, spk_dim: int | None = None) -> None:
    """The two ONNX stand-ins (speech tokenizer, speaker embedding of `spk_dim`, default the
    tiny flow's)."""
    torch.manual_seed(5)
    tok = _SpeechTokenizer().eval()
    spk = _Speaker(spk_dim or manifest()["flow"]["spk_embed_dim"]).eval()
    torch.onnx.export(tok, (torch.randn(1, 128, 40), torch.tensor([40], dtype=torch.int32)),
                      folder / "speech_tokenizer_v3.onnx", input_names=["feats", "feats_length"],
                      output_names=["tokens"], dynamic_axes={"feats": {2: "T"}, "tokens": {1: "N"}},
                      dynamo=False)
    torch.onnx.export(spk, (torch.randn(1, 40, 80),), folder / "campplus.onnx",
                      input_names=["input"], output_names=["embedding"],
                      dynamic_axes={"input": {1: "T"}}, dynamo=False)


def write_served(folder: Path) -> Path:
    """The whole tiny folder `omnistage serve` takes: flow, HiFT, LM, tokenizer, the two ONNX
    stand-ins (no config.json: cosyvoice3.yaml marks the folder, as released)."""
    write_checkpoint(folder)
    write_llm(folder)
    write_tokenizer(folder)
    write_onnx(folder)
    return folder
