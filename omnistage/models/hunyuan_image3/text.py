"""The text HunyuanImage-3.0 writes (its think / recaption answer before an image, its choice of
ratio): a causal LM over 1D rope positions (y = x = the token's index), ln_f, the LM head, greedy
decoding with a contiguous KV cache. The upstream runs it through transformers' generate with
its own static cache; this is the same arithmetic token by token."""

from __future__ import annotations

import torch
from torch import Tensor

from omnistage.models.hunyuan_image3.model import HunyuanImage3
from omnistage.models.hunyuan_image3.transformer import rope_cos_sin


def _forward(model: HunyuanImage3, ids: Tensor, start: int, kv):
    """ids (1, S) at positions start.. after `kv` (None or each layer's (k, v) of `start`
    tokens) -> last position's logits and the cache with these tokens."""
    s = ids.shape[1]
    pos = torch.arange(start, start + s, device=ids.device)[None, :, None].expand(1, s, 2)
    cos, sin = rope_cos_sin(pos, model.cfg.head_dim, model.cfg.rope_theta)
    keys = torch.arange(start + s, device=ids.device)
    mask = (keys[None, :] <= pos[0, :, :1])[None, None]                # (1, 1, S, start + S)
    hidden, new = model.model(model.model.wte(ids), cos, sin, mask, kv)
    if kv is not None:
        new = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1)
               in zip(kv, new)]
    logits = model.lm_head(model.model.ln_f(hidden[:, -1]))
    return logits.float(), new


@torch.no_grad()
def greedy_text(model: HunyuanImage3, ids: Tensor, max_new_tokens: int,
                stop_ids: tuple[int, ...] = ()) -> list[int]:
    """ids (1, S) -> up to max_new_tokens greedy tokens, ending at the first of stop_ids."""
    out: list[int] = []
    logits, kv = _forward(model, ids, 0, None)
    start = ids.shape[1]
    for _ in range(max_new_tokens):
        token = int(logits.argmax(-1))
        out.append(token)
        if token in stop_ids:
            break
        logits, kv = _forward(model, torch.tensor([[token]], device=ids.device), start, kv)
        start += 1
    return out
