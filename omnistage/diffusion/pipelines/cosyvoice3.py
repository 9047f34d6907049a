"""CosyVoice3 speech: tokens -> mel (the flow's DiT, integrated by cosine Euler) -> waveform
(HiFT), cloning the voice of a prompt: its speech tokens, its mel and its x-vector.

    1. mu = flow.encode_tokens([prompt tokens | tokens]); spks = flow.speaker(x-vector)
       cond = [prompt mel | zeros]; x = the fixed noise's first T frames
    2. num_steps Euler steps from t = 0 to 1 on the cosine grid, each one guided velocity
       (both CFG halves in one batch)
    3. mel = x past the prompt's frames; waveform = hift(mel)

The noise is upstream's: seed 0, randn(1, mel, 15000), read from its start for every request,
so the same tokens give the same mel (the reference's CausalConditionalCFM.rand_noise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from omnistage.diffusion.solvers.cosine_euler import cosine_times, euler_update
from omnistage.models.cosyvoice3.flow import CausalMaskedDiffWithDiT

NOISE_FRAMES = 50 * 300      # upstream's buffer: 300 s of 50 Hz mel


def fixed_noise(mel_dim: int, device: torch.device | str = "cpu") -> Tensor:
    """(NOISE_FRAMES, mel): upstream's `set_all_random_seed(0); torch.randn([1, 80, 15000])`."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(1, mel_dim, NOISE_FRAMES, generator=gen)[0].T.contiguous().to(device)


@dataclass(frozen=True, slots=True)
class CloneInput:
    """One request: the tokens to speak and the voice to clone (the prompt's speech tokens,
    its mel (R, mel) with R = token_mel_ratio * len(prompt_tokens), its x-vector)."""

    tokens: Tensor               # (N,) long
    prompt_tokens: Tensor        # (P,) long
    prompt_mel: Tensor           # (R, mel)
    xvector: Tensor              # (spk_embed_dim,)
    streaming: bool = False      # the DiT's chunk mask, as upstream's streaming inference
    finalize: bool = True        # False: a stream's chunk; the last pre_lookahead_len tokens
                                 # are only the look-ahead of those before (no mel of theirs)


@torch.no_grad()
def token2mel(flow: CausalMaskedDiffWithDiT, inputs: list[CloneInput], noise: Tensor,
              num_steps: int = 10) -> list[Tensor]:
    """Each request's mel (T_b, mel) past its prompt, the requests batched together (rows
    padded on the right; a row equals its run alone). A row with finalize=False gets no mel
    for its last pre_lookahead_len tokens: they are the look-ahead of those before, which see
    them as upstream's PreLookaheadLayer `context` (the same as the zero-padded whole run's
    first rows: conv1 reads ahead, conv2 is causal)."""
    ratio, dev = flow.cfg.token_mel_ratio, noise.device
    seqs = [torch.cat([i.prompt_tokens, i.tokens]).to(dev) for i in inputs]
    lengths = torch.tensor([len(s) for s in seqs], device=dev)
    tokens = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    mu = flow.encode_tokens(tokens, lengths)                          # (B, T, mel)
    held = torch.tensor([0 if i.finalize else flow.cfg.pre_lookahead_len for i in inputs],
                        device=dev)
    frames = (lengths - held) * ratio
    mu = mu * (torch.arange(mu.shape[1], device=dev)[None] < frames[:, None])[..., None]
    cond = torch.zeros_like(mu)
    for b, i in enumerate(inputs):
        assert i.prompt_mel.shape[0] <= int(frames[b]), (i.prompt_mel.shape, int(frames[b]))
        cond[b, :i.prompt_mel.shape[0]] = i.prompt_mel.to(cond)
    spks = flow.speaker(torch.stack([i.xvector for i in inputs]).to(mu))
    x = noise[:mu.shape[1]].to(mu).unsqueeze(0).repeat(len(inputs), 1, 1)
    streaming = torch.tensor([i.streaming for i in inputs], device=dev)
    times = cosine_times(num_steps, dev, mu.dtype)
    for k in range(num_steps):
        t = times[k].expand(len(inputs))
        v = flow.guided_velocity(x, t, mu, spks, cond, frames, streaming)
        x = euler_update(x, v, times[k], times[k + 1])
    return [x[b, i.prompt_mel.shape[0]:int(frames[b])] for b, i in enumerate(inputs)]
