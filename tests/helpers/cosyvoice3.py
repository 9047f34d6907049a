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
