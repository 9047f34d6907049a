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
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from omnistage.diffusion.solvers.cosine_euler import cosine_times, euler_update
from omnistage.layers.graph_capture import PaddedShapes
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


Solver = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@torch.no_grad()
def token2mel(flow: CausalMaskedDiffWithDiT, inputs: list[CloneInput], noise: Tensor,
              num_steps: int = 10, shapes: PaddedShapes | None = None,
              solver: Solver | None = None) -> list[Tensor]:
    """Each request's mel (T_b, mel) past its prompt, the requests batched together (rows
    padded on the right; a row equals its run alone). A row with finalize=False gets no mel
    for its last pre_lookahead_len tokens: they are the look-ahead of those before, which see
    them as upstream's PreLookaheadLayer `context` (the same as the zero-padded whole run's
    first rows: conv1 reads ahead, conv2 is causal).
    shapes: the batch padded further, to shapes.rows(B, T) rows of shapes.length(T) frames
    (padding rows: one frame, no speaker, no prompt), what CUDA graphs replay; solver: what
    runs the Euler steps, `solve`'s arguments but the flow (default: `solve` itself)."""
    ratio, dev = flow.cfg.token_mel_ratio, noise.device
    seqs = [torch.cat([i.prompt_tokens, i.tokens]).to(dev) for i in inputs]
    lengths = torch.tensor([len(s) for s in seqs], device=dev)
    tokens = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    mu = flow.encode_tokens(tokens, lengths)                          # (B, T, mel)
    held = torch.tensor([0 if i.finalize else flow.cfg.pre_lookahead_len for i in inputs],
                        device=dev)
    frames = (lengths - held) * ratio
    mu = mu * (torch.arange(mu.shape[1], device=dev)[None] < frames[:, None])[..., None]
    spks = flow.speaker(torch.stack([i.xvector for i in inputs]).to(mu))
    num, length = len(inputs), mu.shape[1]
    if shapes is not None:
        num, length = shapes.rows(len(inputs), length), shapes.length(length)
    frames_cpu = [int(f) for f in frames.cpu()]                       # one copy, one sync
    cond = mu.new_zeros(num, length, mu.shape[2])
    for b, i in enumerate(inputs):
        assert i.prompt_mel.shape[0] <= frames_cpu[b], (i.prompt_mel.shape, frames_cpu[b])
        cond[b, :i.prompt_mel.shape[0]] = i.prompt_mel.to(cond)
    mu = F.pad(mu, (0, 0, 0, length - mu.shape[1], 0, num - mu.shape[0]))
    spks = F.pad(spks, (0, 0, 0, num - spks.shape[0]))
    frames = F.pad(frames, (0, num - frames.shape[0]), value=1)
    streaming = torch.tensor([i.streaming for i in inputs] + [False] * (num - len(inputs)),
                             device=dev)
    x = noise[:length].to(mu).unsqueeze(0).repeat(num, 1, 1)
    times = cosine_times(num_steps, dev, mu.dtype)
    if solver is None:
        x = solve(flow, x, mu, spks, cond, frames, streaming, times)
    else:
        x = solver(x, mu, spks, cond, frames, streaming, times)
    return [x[b, i.prompt_mel.shape[0]:frames_cpu[b]] for b, i in enumerate(inputs)]


def solve(flow: CausalMaskedDiffWithDiT, x: Tensor, mu: Tensor, spks: Tensor, cond: Tensor,
          frames: Tensor, streaming: Tensor, times: Tensor) -> Tensor:
    """The Euler steps over `times` (num_steps + 1,) from the noise x (B, T, mel), float32
    whatever the DiT computes in: tensor work only (no host sync, no host data), so that a
    CUDA graph can replay it (generation/cosyvoice3.py's `cuda_graphs`)."""
    for k in range(times.shape[0] - 1):
        t = times[k].expand(x.shape[0])
        v = flow.guided_velocity(x, t, mu, spks, cond, frames, streaming)
        x = euler_update(x, v, times[k], times[k + 1])
    return x
