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
    # the feedback's extras of a request's last token are output too (True where they are real
    # output, as MiMo-Audio's patch of audio codes; False: the last token is never fed back)
    keeps_last_extras: bool = False
    # the tokenizer's EOS also ends generation (False: the model's outputs are not text ids,
    # as a TTS talker's codec ids, whose stop is the model config's EOS alone)
    stops_at_tokenizer_eos: bool = True
