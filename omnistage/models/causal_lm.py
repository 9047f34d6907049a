"""What every autoregressive model is to the AR engine (`ar.model_runner.ARModel`): besides
forward, compute_logits and embed_input_ids, the optional abilities it declares here, off by
default, so that the engine reads them instead of probing for them."""

from __future__ import annotations

from typing import Callable

from torch import nn


class CausalLM(nn.Module):
    # positions are (3, T) multimodal rotary positions (and a request carries its rope delta)
    uses_mrope: bool = False
    # after sampling: (last hidden (B, H), sampled ids (B,), sequences) -> (the embeddings the
    # next step is fed (B, H), one dict of extras per row); None: the sampled ids are fed back
    feedback: Callable | None = None
