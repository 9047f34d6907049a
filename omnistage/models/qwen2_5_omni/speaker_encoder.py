"""ECAPA-TDNN: the token2wav DiT's speaker encoder, a reference mel (B, R, mel) -> one vector
(B, enc_dim) per utterance (Desplanques et al., 2020).

    TDNN (conv + ReLU) -> (n - 2) x SE-Res2Net blocks -> concat of their outputs -> TDNN (mfa)
    -> attentive statistics pooling (weighted mean and std over time) -> 1x1 conv (fc)

Every convolution pads "same" by reflection, as the reference's. Parameter names follow the
checkpoint's `...input_embed.spk_encoder.*`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _conv(cin: int, cout: int, kernel: int = 1, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TimeDelayNetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = _conv(cin, cout, kernel, dilation)

    def forward(self, x: Tensor) -> Tensor:                       # (B, C, T)
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """The channels in `scale` groups; group i > 0 is convolved after adding group i - 1's
    output (i > 1), group 0 passes through."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(
            TimeDelayNetBlock(channels // scale, channels // scale, kernel, dilation)
            for _ in range(scale - 1))

    def forward(self, x: Tensor) -> Tensor:
        outs: list[Tensor] = []
        for i, part in enumerate(torch.chunk(x, self.scale, dim=1)):
            outs.append(part if i == 0 else self.blocks[i - 1](part if i == 1 else part + outs[-1]))
        return torch.cat(outs, dim=1)


class SqueezeExcitationBlock(nn.Module):
    def __init__(self, channels: int, se_channels: int) -> None:
        super().__init__()
        self.conv1 = _conv(channels, se_channels)
        self.conv2 = _conv(se_channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SqueezeExcitationRes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se_channels: int, kernel: int,
                 dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(cin, cout, 1, 1)
        self.res2net_block = Res2NetBlock(cout, scale, kernel, dilation)
        self.tdnn2 = TimeDelayNetBlock(cout, cout, 1, 1)
        self.se_block = SqueezeExcitationBlock(cout, se_channels)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _statistics(x: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Weighted mean and std over time: x (B, C, T), weights (B, C or 1, T) summing to 1."""
    mean = (weights * x).sum(2)
    std = torch.sqrt((weights * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(1e-12))
    return mean, std


class AttentiveStatisticsPooling(nn.Module):
    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels)

    def forward(self, x: Tensor) -> Tensor:                       # (B, C, T) -> (B, 2C, 1)
        num_frames = x.shape[-1]
        uniform = torch.full_like(x[:, :1], 1.0 / num_frames)
        mean, std = _statistics(x, uniform)
        context = torch.cat([x, mean.unsqueeze(2).expand_as(x), std.unsqueeze(2).expand_as(x)], 1)
        attention = F.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        return torch.cat(_statistics(x, attention), dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    def __init__(self, mel_dim: int, channels: list[int], kernels: list[int],
                 dilations: list[int], attention_channels: int, res2net_scale: int,
                 se_channels: int, out_dim: int) -> None:
        super().__init__()
        if not len(channels) == len(kernels) == len(dilations):
            raise ValueError(f"dit_config: enc_channels {channels}, enc_kernel_sizes {kernels} "
                             f"and enc_dilations {dilations} differ in length")
        self.blocks = nn.ModuleList([TimeDelayNetBlock(mel_dim, channels[0], kernels[0],
                                                       dilations[0])])
        self.blocks.extend(SqueezeExcitationRes2NetBlock(
            channels[i - 1], channels[i], res2net_scale, se_channels, kernels[i], dilations[i])
            for i in range(1, len(channels) - 1))
        self.mfa = TimeDelayNetBlock(channels[-1], channels[-1], kernels[-1], dilations[-1])
        self.asp = AttentiveStatisticsPooling(channels[-1], attention_channels)
        self.fc = _conv(channels[-1] * 2, out_dim)

    def forward(self, mel: Tensor) -> Tensor:                     # (B, R, mel) -> (B, out_dim)
        h = mel.transpose(1, 2)
        outs = []
        for block in self.blocks:
            h = block(h)
            outs.append(h)
        h = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(h)).squeeze(-1)
