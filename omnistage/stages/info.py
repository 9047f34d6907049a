"""What a stage tells the front door about itself in the Ready handshake (`Ready.info`): the
facts requests are checked against, and what /v1/models and the start-up log show. Every
field any stage writes is here, typed, with the default of a stage that has no such fact."""

from __future__ import annotations

import msgspec


class StageInfo(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    # an AR stage (stages/ar.py): its limits and its KV cache, for the prompt checks
    # (engine/inputs.py) and the start-up log line (stages/process.py)
    max_model_len: int | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_kv_blocks: int | None = None
    kv_block_size: int | None = None
    kv_cache_gib: float | None = None
    device: str | None = None
    dtype: str | None = None
    cuda_graphs: tuple[int, ...] = ()      # the decode batch sizes replayed from CUDA graphs
    # a talker or a TTS model: the voices (and languages) a request may name
    speakers: tuple[str, ...] = ()
    languages: tuple[str, ...] = ()
    tts_model_type: str | None = None
    sample_rate: int | None = None         # of the audio the stage writes (a vocoder)
    # an entry AR stage that builds its token ids from the prompt's text itself (GLM-Image's:
    # its chat template and the image's token grids): the front door sends it the text
    text_prompt: bool = False
    max_input_images: int | None = None    # an edit's input images the stage takes at most
    # the generic diffusers adapter: backend "diffusers" and the pipeline class (/v1/models
    # shows the model as not native); None for our own engines
    backend: str | None = None
    pipeline: str | None = None

    def merged(self, extra: StageInfo) -> StageInfo:
        """These facts with `extra`'s set fields over them (a model's beside its engine's)."""
        changes = {f.name: getattr(extra, f.name) for f in msgspec.structs.fields(extra)
                   if getattr(extra, f.name) != f.default}
        return msgspec.structs.replace(self, **changes)
