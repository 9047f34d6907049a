"""MiMo-Audio (Xiaomi): a Qwen2 LLM over patches of audio frames, speech in and speech out.

One LLM position holds a patch of `group_size` frames: its text id (the same for every frame;
`empty_idx` marks a speech patch) and `audio_channels` RVQ ids per frame.
    patch encoder: sum of the channels' speech embeddings (empty ids -> 0) per frame
                   -> input_local_transformer over the patch's frames (causal, or both ways
                      with input_full_attention, as the released configs set)
                   -> concat frames -> speech_group_downcast -> + text embedding (0 if empty)
    LLM:           Qwen2 over the patches -> lm_head (text id) and hidden_states_downcast
    patch decoder: local_transformer fed the downcast hidden state, then each step the sum of
                   the ids it just drew (embedded, projected); channel c draws frame f at step
                   delays[c] + f, its empty id never drawn.
A text id other than `empty_idx` gives a patch of empty audio ids (the decoder is not run).

Parameter names are upstream MiMoAudioForCausalLM's (its save_pretrained layout): model.*,
lm_head, local_transformer.*, input_local_transformer.*, local_transformer_lm_heads.{c},
speech_embeddings.{c}, speech_embeddings_to_local (only when the two local widths differ),
speech_group_downcast, hidden_states_downcast.

On the AR engine (a CausalLM): the LLM runs on the engine's paged KV cache, fed each prompt
patch's `patch_embeds`; the engine's sampler draws the text id; the `feedback` hook then runs the
patch decoder (greedy, or the request's temperature / top-k / top-p from its own generator) and
feeds the new patch's `patch_embeds` to the next position. The two local decoders keep no cache
(`private_cache`: the engine leaves them out) and run a fresh prefill over at most
group_size + max(delays) rows, the patch decoder's draws pre-drawn and its passes on tensors
alone (patch_graphs.py; on CUDA the stage replays them from CUDA graphs, `patch_graphs`).
`generate` is the same maths without the engine (the golden reference of the layout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.attention import AttentionMetadata
from omnistage.layers.linear import Linear
from omnistage.layers.parallel import VocabParallelEmbedding
from omnistage.layers.sampling import GREEDY_EPS, apply_top_k_top_p
from omnistage.models.causal_lm import CausalLM
from omnistage.models.config import ModelConfig
from omnistage.models.loader import load_packed_weights
from omnistage.models.mimo_audio.config import MiMoAudioConfig
from omnistage.models.mimo_audio.patch_graphs import (DenseMetas, PatchGraphs, decode_rows,
                                                      dense_metadata, forward_dense,
                                                      row_sampling)
from omnistage.models.qwen3_omni.talker import FRAME_CODES
from omnistage.models.qwen2 import Qwen2ForCausalLM, Qwen2Model


def dense_forward(model: Qwen2Model, embeds: Tensor) -> Tensor:
    """embeds (N, L, hidden): N independent sequences of L rows, causal, no cache -> the
    decoder's output after its final norm, (N, L, hidden)."""
    n, length, _ = embeds.shape
    positions = torch.arange(length, device=embeds.device).repeat(n)
    return forward_dense(model, embeds, dense_metadata(n, length, embeds.device), positions)


class _DenseAttention:
    """An attention backend for N cache-less sequences of one length in one batched SDPA:
    causal (the patch decoder), or each row attending to all of its sequence (the patch
    encoder with input_full_attention). Reads only the metadata's host sizes."""

    def __init__(self, causal: bool) -> None:
        self.causal = causal

    def prepare(self, md: AttentionMetadata, has_cache: bool) -> None:
        pass

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor | None,
                v_cache: Tensor | None, md: AttentionMetadata, scale: float) -> Tensor:
        n, length = md.num_seqs, md.max_query_len

        def heads(x: Tensor) -> Tensor:                        # (N L, H, D) -> (N, H, L, D)
            return x.view(n, length, *x.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), scale=scale,
                                           is_causal=self.causal and length > 1,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return o.transpose(1, 2).reshape(q.shape)


def _drawer(seq: object) -> Callable[[Tensor], Tensor] | None:
    """A sequence's patch-decoder draw: None (greedy) at temperature 0, else the engine
    sampler's maths on one channel's logits (V,): temperature, top-k, top-p, then the
    exponential race from the request's own generator (seeded) or the global one."""
    p = seq.sampling_params                                        # type: ignore[attr-defined]
    if p.temperature < GREEDY_EPS:
        return None
    gen = getattr(seq, "generator", None)

    def draw(logits: Tensor) -> Tensor:
        vocab, dev = logits.shape[0], logits.device
        x = (logits / p.temperature)[None]
        x = apply_top_k_top_p(x, torch.tensor([p.top_k if p.top_k > 0 else vocab], device=dev),
                              torch.tensor([p.top_p], device=dev))
        probs = torch.softmax(x, dim=-1)[0]
        q = torch.empty_like(probs).exponential_(generator=gen)
        return torch.where(probs > 0, probs / q.clamp_min(torch.finfo(q.dtype).tiny),
                           -1.0).argmax()
    return draw


class MiMoAudioForCausalLM(CausalLM):
    packed_modules = Qwen2ForCausalLM.packed_modules
    keeps_last_extras = True     # the last step's patch of audio ids was drawn: it is output

    def __init__(self, cfg: MiMoAudioConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d_llm, d_loc, d_in = (cfg.llm.hidden_size, cfg.local.hidden_size,
                              cfg.input_local.hidden_size)
        self.model = Qwen2Model(cfg.llm)
        self.lm_head = Linear(d_llm, cfg.llm.vocab_size, bias=False)
        self.local_transformer = Qwen2Model(cfg.local)
        self.local_transformer.embed_tokens = None
        self.input_local_transformer = Qwen2Model(cfg.input_local)
        self.input_local_transformer.embed_tokens = None
        for local in (self.local_transformer, self.input_local_transformer):
            for layer in local.layers:         # cache-less: the engine's paged cache skips them
                layer.self_attn.attn.private_cache = True
        if cfg.input_full_attention:
            for layer in self.input_local_transformer.layers:
                layer.self_attn.attn.backend = _DenseAttention(causal=False)
        for layer in self.local_transformer.layers:
            layer.self_attn.attn.backend = _DenseAttention(causal=True)
        self.local_transformer_lm_heads = nn.ModuleList(
            Linear(d_loc, v, bias=False) for v in cfg.vocab_sizes)
        self.speech_embeddings = nn.ModuleList(
            VocabParallelEmbedding(v, d_in) for v in cfg.vocab_sizes)
        self.speech_embeddings_to_local = (Linear(d_in, d_loc, bias=False)
                                           if d_in != d_loc else None)
        self.speech_group_downcast = Linear(d_in * cfg.group_size, d_llm, bias=False)
        self.hidden_states_downcast = Linear(d_llm, d_loc, bias=False)
        # the patch decoder's metadata per batch size, and its CUDA graphs (the stage's)
        self.patch_metas = DenseMetas(cfg.group_size + max(cfg.delays))
        self.patch_graphs: PatchGraphs | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, empty_idx: int,
                        device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> MiMoAudioForCausalLM:
        """A save_pretrained folder (config.json + *.safetensors). empty_idx: the tokenizer's
        <|empty|> id (upstream passes it beside the checkpoint, in MiMoAudioArguments)."""
        from safetensors.torch import load_file

        path = Path(path)
        cfg = MiMoAudioConfig.from_folder(path, empty_idx)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = cls(cfg)
        finally:
            torch.set_default_dtype(default)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors")
        loaded: set[str] = set()
        with torch.no_grad():
            for f in files:
                state = load_file(f, device=str(device))
                loaded |= load_packed_weights(model, ((n, t.to(dtype)) for n, t in
                                                      state.items()), cls.packed_modules)
        missing = {n for n, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"{path}: missing {sorted(missing)[:8]}")
        return model.eval()

    def patch_embeds(self, patches: Tensor) -> Tensor:
        """patches (T, group_size, 1 + channels) ids -> the LLM's input rows (T, hidden)."""
        cfg = self.cfg
        text, speech = patches[:, 0, 0], patches[:, :, 1:]
        is_speech = (text == cfg.empty_idx)[:, None, None]
        emb = torch.zeros(*speech.shape[:2], cfg.input_local.hidden_size,
                          dtype=self.speech_group_downcast.weight.dtype, device=patches.device)
        for c, table in enumerate(self.speech_embeddings):
            ids = speech[:, :, c]
            emb = emb + table(ids).masked_fill((ids == cfg.empty_ids[c])[..., None], 0.0)
        emb = dense_forward(self.input_local_transformer, emb * is_speech) * is_speech
        down = self.speech_group_downcast(emb.flatten(1))
        text_emb = self.model.embed_tokens(text).masked_fill(is_speech[:, 0], 0.0)
        return text_emb + down

    # -- the AR engine's model interface ---------------------------------------------------
    @property
    def model_config(self) -> ModelConfig:
        return self.cfg.llm

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        return self.model(input_ids, positions, inputs_embeds, capture_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def feedback(self, last: Tensor, text_ids: Tensor, seqs: list) -> tuple[Tensor, list]:
        """After the engine sampled each row's text id: a speech id (<|empty|>) runs the patch
        decoder on the row's hidden state (every such row of the step in one batch); the new
        patch (text id + audio ids) through the patch encoder is what the next position is
        fed. -> (B, hidden) embeddings and per row {FRAME_CODES: (group_size, channels) audio
        ids} (None for a text patch)."""
        cfg, g, dev = self.cfg, self.cfg.group_size, last.device
        texts = text_ids.tolist()
        rows = [i for i, text in enumerate(texts) if text == cfg.empty_idx]
        speech = torch.tensor(cfg.empty_ids, device=dev).expand(len(texts), g, -1).clone()
        extras: list = [None] * len(texts)
        if rows:
            picked = torch.tensor(rows, device=dev)
            x = self.hidden_states_downcast(last[picked])
            sampling = row_sampling(self, [seqs[i] for i in rows], dev)
            graphs = self.patch_graphs
            decoded = (graphs(x, sampling) if graphs is not None and len(rows) <=
                       graphs.max_batch else decode_rows(self, x, sampling))
            speech[picked] = decoded
            for i, codes in zip(rows, decoded.cpu()):               # one copy to the host
                extras[i] = {FRAME_CODES: codes}
        patches = torch.cat([text_ids.to(dev).view(-1, 1, 1).expand(-1, g, 1), speech], 2)
        return self.patch_embeds(patches).to(last.dtype), extras

    def decode_patch(self, x: Tensor, draw: Callable[[Tensor], Tensor] | None = None
                     ) -> Tensor:
        """x (hidden_local,) the downcast LLM state -> one patch's audio ids with upstream's
        delay pattern: (group_size, channels). draw: logits (V,) -> id; None: greedy."""
        return self.decode_patches(x[None], [draw])[0]

    def decode_patches(self, x: Tensor, draws: list[Callable[[Tensor], Tensor] | None]
                       ) -> Tensor:
        """`decode_patch` of B rows at once: x (B, hidden_local), draws[b] row b's draw ->
        (B, group_size, channels). Rows never mix (independent sequences through the local
        transformer, each row's logits drawn by its own draw, in the same order as alone).
        The reference of per-row draws: the feedback hook runs `patch_graphs.decode_rows`,
        the same ids from tensors alone (its noise pre-drawn in this order)."""
        cfg, g = self.cfg, self.cfg.group_size
        b = x.shape[0]
        tokens = torch.zeros(b, g, cfg.audio_channels, dtype=torch.long, device=x.device)
        rows = [x]
        greedy = all(d is None for d in draws)
        for t in range(g + max(cfg.delays)):
            h = dense_forward(self.local_transformer, torch.stack(rows, 1))[:, -1]   # (B, D)
            nxt = torch.zeros_like(x)
            for c, delay in enumerate(cfg.delays):
                if not delay <= t < delay + g:
                    continue
                logits = self.local_transformer_lm_heads[c](h).float()          # (B, V)
                logits[:, cfg.empty_ids[c]] = float("-inf")
                tok = logits.argmax(-1) if greedy else torch.stack(
                    [row.argmax() if d is None else d(row) for row, d in zip(logits, draws)])
                tokens[:, t - delay, c] = tok
                e = self.speech_embeddings[c](tok)
                nxt = nxt + (e if self.speech_embeddings_to_local is None
                             else self.speech_embeddings_to_local(e))
            rows.append(nxt)
        return tokens

    @torch.no_grad()
    def generate(self, prompt: Tensor, steps: int, force_speech: bool = False) -> Tensor:
        """prompt (T * group_size * (1 + channels),) upstream's flat layout -> the `steps`
        new patches in the same layout. Greedy text; force_speech: the text id is <empty>
        every step (each step speaks a patch)."""
        cfg = self.cfg
        g, width = cfg.group_size, cfg.audio_channels + 1
        patches = prompt.view(-1, g, width)
        empties = torch.tensor(cfg.empty_ids, device=prompt.device)
        for _ in range(steps):
            h = dense_forward(self.model, self.patch_embeds(patches)[None])[0, -1]
            text = (torch.tensor(cfg.empty_idx, device=prompt.device) if force_speech
                    else self.lm_head(h).float().argmax())
            speech = (self.decode_patch(self.hidden_states_downcast(h))
                      if int(text) == cfg.empty_idx else empties.expand(g, -1))
            new = torch.cat([text.view(1, 1).expand(g, 1), speech], dim=1)
            patches = torch.cat([patches, new[None]])
        return patches[-steps:].reshape(-1)
