"""Qwen3-TTS text processing and the talker's prompt for each of the three modes, as the
reference (`qwen_tts`: `Qwen3TTSModel.generate_*` and `Qwen3TTSForConditionalGeneration.generate`)
lays them out.

Every talker position adds a text row and a codec row (both in the talker's width). With
`text = <|im_start|>assistant\\n T0 T1 .. Tn <|im_end|>\\n<|im_start|>assistant\\n`:

    [instruct: text(<|im_start|>user\\n {instruct} <|im_end|>\\n), no codec row]   optional
    text:   im_start  assistant  \\n    pad     pad    ..  pad       bos        T0
    codec:     -         -        -   think  think_bos [lang] think_eos [spk] pad  bos

(no language: `nothink think_bos think_eos`; the speaker row is a preset's codec embedding or a
clone's x-vector). Then each generated frame's embedding is added to the next text row
(`trailing`: T1 .. Tn, tts_eos), then tts_pad for ever. Non-streaming text puts all of
T0 .. Tn, tts_eos over codec pads in the prompt and ends it with (tts_pad, codec bos).

Voice clone in context (Base, `ref_code` given) replaces the T0 row with the reference
transcript and text over the reference clip's frames:

    text:   ref_text.. T0 .. Tn  tts_eos       (streaming: zipped with the codec rows,
    codec:  bos  frame0  frame1 ..                the longer side's rest trails / pads)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from omnistage.models.qwen3_tts.config import Qwen3TTSConfig
from omnistage.models.qwen3_tts.talker import Qwen3TTSTalkerForCausalLM


@dataclass(frozen=True)
class SpeechRequest:
    """One utterance. CustomVoice: `speaker` (a preset) and an optional `instruct` (style);
    VoiceDesign: `instruct` describes the voice; Base: `speaker_embedding` (the reference
    clip's x-vector) and, for in-context cloning, `ref_code` (its frames (T, G)) and
    `ref_text` (its transcript). `non_streaming_mode` None: the reference's default for the
    mode (all text in the prompt for CustomVoice and VoiceDesign, text fed along for Base)."""
    text: str
    language: str = "auto"
    speaker: str | None = None
    instruct: str | None = None
    speaker_embedding: Tensor | None = None
    ref_code: Tensor | None = None
    ref_text: str | None = None
    non_streaming_mode: bool | None = None


@dataclass(frozen=True)
class TalkerPrompt:
    embeds: Tensor      # (L, H) the prompt's input embeddings
    trailing: Tensor    # (N, H) text rows added to the first N generated steps' inputs
    pad: Tensor         # (H,) the text row of every later step (tts_pad)


class PromptBuilder:
    """Turns `SpeechRequest`s into `TalkerPrompt`s with the talker's embeddings."""

    def __init__(self, config: Qwen3TTSConfig, talker: Qwen3TTSTalkerForCausalLM,
                 tokenizer: PreTrainedTokenizerBase) -> None:
        self.config = config
        self.talker = talker
        self.tokenizer = tokenizer

    def tokens(self, text: str) -> Tensor:
        ids = self.tokenizer(text).input_ids
        return torch.tensor(ids, dtype=torch.long, device=self.talker.codec_head.weight.device)

    def codec(self, *ids: int) -> Tensor:
        """Codec ids -> (n, H) talker embeddings."""
        dev = self.talker.codec_head.weight.device
        return self.talker.embed_input_ids(torch.tensor(ids, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def build(self, req: SpeechRequest, text_open: bool = False) -> TalkerPrompt:
        """text_open: `req.text` is the first part of a text still being written (a voice
        agent's LLM): the text is fed along (streaming mode), and `trailing` stops after the
        part's own tokens, without tts_eos (`text_rows` gives the next parts', `eos_row` the
        end)."""
        self.check(req)
        if text_open and (self.non_streaming(req) or req.ref_code is not None):
            raise ValueError("text: text still being written is fed along the speech "
                             "(streaming mode), without in-context cloning")
        cfg = self.config
        text_ids = self.tokens(f"<|im_start|>assistant\n{req.text}<|im_end|>\n"
                               "<|im_start|>assistant\n")
        bos, eos, pad = self.talker.embed_text(self.tokens_of(
            cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id))
        codec = self.codec_prefix(req)                               # (C, H), ends pad, bos
        texts = torch.cat([pad.expand(codec.shape[0] - 2, -1), bos[None]])
        rows = [self.talker.embed_text(text_ids[:3]), texts + codec[:-1]]
        body = text_ids[3:-5]                                        # the text's own tokens
        if req.instruct and self.uses_instruct():
            rows.insert(0, self.talker.embed_text(
                self.tokens(f"<|im_start|>user\n{req.instruct}<|im_end|>\n")))
        if req.ref_code is not None:
            ref_ids = self.tokens(f"<|im_start|>assistant\n{req.ref_text}<|im_end|>\n")[3:-2]
            icl, trailing = self.in_context(torch.cat([ref_ids, body]), req.ref_code, eos, pad,
                                            self.non_streaming(req))
            rows.append(icl)
        elif self.non_streaming(req):
            rows.append(torch.cat([self.talker.embed_text(body), eos[None]])
                        + self.codec(*[cfg.codec.pad] * (body.shape[0] + 1)))
            rows.append(pad[None] + self.codec(cfg.codec.bos))
            trailing = pad[None]
        else:
            rows.append(self.talker.embed_text(body[:1]) + codec[-1:])
            trailing = self.talker.embed_text(body[1:])
            if not text_open:
                trailing = torch.cat([trailing, eos[None]])
        return TalkerPrompt(torch.cat(rows), trailing, pad)

    @torch.inference_mode()
    def text_rows(self, text: str) -> Tensor:
        """(n, H) the text rows of a later part of a text still being written (its tokens as
        they are within the whole text: parts start before whitespace, stages/speakable.py)."""
        return self.talker.embed_text(self.tokens(text))

    @torch.inference_mode()
    def eos_row(self) -> Tensor:
        """(1, H) tts_eos's text row: the written text's end."""
        return self.talker.embed_text(self.tokens_of(self.config.tts_eos_token_id))

    def tokens_of(self, *ids: int) -> Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.talker.codec_head.weight.device)

    def codec_prefix(self, req: SpeechRequest) -> Tensor:
        """(C, H): the think tags with the language, the speaker row, then pad and bos."""
        c = self.config.codec
        lang = self.language_id(req)
        ids = [c.nothink, c.think_bos, c.think_eos] if lang is None else \
            [c.think, c.think_bos, lang, c.think_eos]
        parts = [self.codec(*ids)]
        if req.speaker_embedding is not None:
            parts.append(req.speaker_embedding.reshape(1, -1).to(parts[0]))
        elif req.speaker:
            parts.append(self.codec(self.config.speakers[req.speaker.lower()]))
        parts.append(self.codec(c.pad, c.bos))
        return torch.cat(parts)

    def language_id(self, req: SpeechRequest) -> int | None:
        """The language's codec id (None for "auto"); a preset speaker's dialect replaces
        Chinese or auto."""
        lang = req.language.lower()
        speaker = (req.speaker or "").lower()
        if lang in ("chinese", "auto") and speaker in self.config.speaker_dialects:
            return self.config.languages[self.config.speaker_dialects[speaker]]
        return None if lang == "auto" else self.config.languages[lang]

    def in_context(self, text_ids: Tensor, ref_code: Tensor, eos: Tensor, pad: Tensor,
                   non_streaming: bool) -> tuple[Tensor, Tensor]:
        """The in-context clone's rows: reference transcript + text (then tts_eos) over codec
        bos + the reference frames. -> (rows, trailing)."""
        text = torch.cat([self.talker.embed_text(text_ids), eos[None]])          # (Nt, H)
        frames = self.talker.embed_frames(ref_code.to(text.device, torch.long))
        codec = torch.cat([self.codec(self.config.codec.bos), frames])           # (Nc, H)
        nt, nc = text.shape[0], codec.shape[0]
        if non_streaming:
            rows = torch.cat([text + self.codec(*[self.config.codec.pad] * nt), codec + pad])
            return rows, pad[None]
        if nt > nc:
            return text[:nc] + codec, text[nc:]
        return torch.cat([text, pad.expand(nc - nt, -1)]) + codec, pad[None]

    def non_streaming(self, req: SpeechRequest) -> bool:
        if req.non_streaming_mode is not None:
            return req.non_streaming_mode
        return self.config.model_type != "base"

    def uses_instruct(self) -> bool:
        """The 0.6B CustomVoice model takes no instruction (the reference drops it)."""
        return not (self.config.model_type == "custom_voice" and self.config.model_size == "0b6")

    def check(self, req: SpeechRequest) -> None:
        """ValueError naming the field, for what the model cannot do."""
        cfg = self.config
        if not req.text:
            raise ValueError("text: empty")
        if req.language.lower() not in cfg.supported_languages:
            raise ValueError(f"language {req.language!r}: supported are "
                             f"{cfg.supported_languages}")
        if req.speaker and req.speaker.lower() not in cfg.speakers:
            raise ValueError(f"speaker {req.speaker!r}: supported are {sorted(cfg.speakers)}")
        is_clone = req.speaker_embedding is not None
        if is_clone != (cfg.model_type == "base"):
            raise ValueError(f"speaker_embedding: a {cfg.model_type} model "
                             + ("needs one (voice clone)" if cfg.model_type == "base"
                                else "clones no voice"))
        if req.ref_code is not None and not req.ref_text:
            raise ValueError("ref_text: in-context cloning (ref_code) needs the transcript")
