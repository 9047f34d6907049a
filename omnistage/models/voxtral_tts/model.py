"""Voxtral-TTS on the AR engine (a CausalLM): the Mistral backbone on the paged KV cache, the
generation head in the per-step feedback hook.

    prompt   [BOS] [BEGIN_AUDIO] [AUDIO] x n <text> [BEGIN_AUDIO]: text ids through the text
             table, the [AUDIO] run through the packed audio table (a voice's frames)
    logits   forced, as vLLM-Omni's: only [AUDIO] is allowed, or EOS where the head's semantic
             argmax is [END_AUDIO] (so the engine's sampler stops the request there)
    feedback the head on each row's last hidden state (noise from the request's seeded
             generator, or the global one; cfg_alpha from SamplingParams.extra, default 1.2)
             -> the frame (37 codes, +2 specials) as the step's extra; the next position is
             fed the frame's packed embedding. On CUDA the stage sets `head_graphs`: the
             head's 7 guided Euler steps (hundreds of small kernels a frame) replayed as one
             graph per batch-size bucket
The [END_AUDIO] frame is not audio: its extras are dropped with the last token
(`keeps_last_extras` False)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from omnistage.layers.graph_capture import RowGraphs
from omnistage.models.causal_lm import CausalLM
from omnistage.models.config import ModelConfig
from omnistage.models.qwen2 import Qwen2Model
from omnistage.models.qwen3_omni.talker import FRAME_CODES
from omnistage.models.voxtral_tts.backbone import backbone_config, load_backbone
from omnistage.models.voxtral_tts.config import END_AUDIO
from omnistage.models.voxtral_tts.head import VoxtralAudioEmbedding, VoxtralFlowHead

CFG_ALPHA = "cfg_alpha"            # SamplingParams.extra's guidance strength
DEFAULT_CFG_ALPHA = 1.2            # vLLM-Omni's default


class VoxtralTTSForCausalLM(CausalLM):
    stops_at_tokenizer_eos = False   # EOS is forced by the head; the model config carries it

    def __init__(self, model: Qwen2Model, head: VoxtralFlowHead, audio: VoxtralAudioEmbedding,
                 cfg: ModelConfig) -> None:
        super().__init__()
        self.model, self.head, self.audio_embedding, self.cfg = model, head, audio, cfg
        self.audio_token_id = head.cfg.audio_token_id
        self.head_graphs: RowGraphs | None = None    # the head's CUDA graphs (the stage's)

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str = "cpu",
                        dtype: torch.dtype = torch.float32, eos_token_id: int = 2
                        ) -> VoxtralTTSForCausalLM:
        """The release's folder (params.json + consolidated.safetensors); eos_token_id:
        tekken.json's (2 in Mistral's tokenizers)."""
        from omnistage.models.voxtral_tts.config import read_params
        params, _, _ = read_params(folder)
        cfg = replace(backbone_config(params), eos_token_ids=(eos_token_id,),
                      torch_dtype=str(dtype).removeprefix("torch."))
        head = VoxtralFlowHead.from_pretrained(folder, device).to(dtype)
        audio = VoxtralAudioEmbedding.from_pretrained(folder, device).to(dtype)
        return cls(load_backbone(folder, device, dtype), head, audio, cfg).eval()

    @property
    def model_config(self) -> ModelConfig:
        return self.cfg

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def prompt_embeds(self, ids: Tensor, voice: Tensor | None = None) -> Tensor:
        """ids (T,) with a run of [AUDIO] of length n; voice: (n, 37) frames in the LLM's space
        (summed through the packed table), or (n, hidden) ready embeddings (the release's
        `voice_embedding/<name>.pt`, placed as they are, as vLLM-Omni does). -> (T, hidden)."""
        h = self.embed_input_ids(ids)
        slots = (ids == self.audio_token_id).nonzero().flatten()
        if voice is not None:
            if len(slots) != len(voice):
                raise ValueError(f"voice: {len(voice)} frames for {len(slots)} [AUDIO] slots")
            h = h.clone()
            rows = voice.to(ids.device)
            if not rows.is_floating_point():
                rows = self.audio_embedding(rows)
            h[slots] = rows.to(h.dtype)
        return h

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        return self.model(input_ids, positions, inputs_embeds, capture_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """(N, hidden) -> (N, vocab) all -inf but [AUDIO], or EOS where the frame ends."""
        ends = self.head.semantic(hidden) == END_AUDIO
        logits = torch.full((hidden.shape[0], self.cfg.vocab_size), float("-inf"),
                            device=hidden.device)
        logits[~ends, self.audio_token_id] = 0.0
        logits[ends, self.cfg.eos_token_ids[0]] = 0.0
        return logits

    @torch.no_grad()
    def feedback(self, last: Tensor, _ids: Tensor, seqs: list) -> tuple[Tensor, list]:
        """-> the frames' packed embeddings (B, hidden) and per row {FRAME_CODES: (37,)}."""
        n = self.head.cfg.n_acoustic_codebook
        noise = torch.stack([torch.randn(n, generator=_generator(s, last.device),
                                         device=last.device) for s in seqs])
        alpha = torch.tensor([float(s.sampling_params.extra.get(CFG_ALPHA, DEFAULT_CFG_ALPHA))
                              for s in seqs], device=last.device)
        run = self.head if self.head_graphs is None or len(seqs) > self.head_graphs.sizes[-1] \
            else self.head_graphs
        frames = run(last, alpha.to(last.dtype), noise.to(last.dtype))
        extras = [{FRAME_CODES: f} for f in frames.cpu()]          # one copy to the host
        return self.audio_embedding(frames).to(last.dtype), extras


def _generator(seq: object, device: torch.device) -> torch.Generator | None:
    """The request's own generator where it has a seed (made here as the sampler makes it),
    else None (the global one)."""
    seed = seq.sampling_params.seed                                  # type: ignore[attr-defined]
    if seed is None:
        return None
    if getattr(seq, "generator", None) is None:
        seq.generator = torch.Generator(device=device).manual_seed(seed)  # type: ignore
    return seq.generator                                             # type: ignore[attr-defined]
