"""Moshi's full-duplex step for many sessions at once: one `tick` hears one codec frame of each
session's user audio and answers each with one inner-monologue text token and one frame of
Moshi's speech, all sessions' temporal and depth transformers in one engine step.

    open(sid)      a request on the AR engine (models/moshi/engine_model.py `MoshiStepLM`):
                   prompt = the unconditional frame alone (text id vocab_size, every code BOS),
                   its decodes fed by an open input stream, one row a tick
    tick(frames)   per session:
      joined now   the engine's step prefills it: text token 1 and codes c_1; nothing heard
      after        its frame (or silence) ─ Mimi encoder, streamed ─> user codes u_r (K,)
                   row r = sum_k emb[K + k](user_k), user = [u_r[0], u_{r-1}[1:]] (the delay;
                   u_{-1} = BOS) + at r = 0 the BOS embeddings of Moshi's acoustic codebooks
                   the step decodes position r + 1 ─> text token r + 2, codes c_{r+2};
                   Moshi's aligned frame r + 1 = [c_{r+1}[0], c_{r+2}[1:]] ─ Mimi decoder,
                   streamed ─> frame_size samples
    close(sid)     the request aborted, its KV blocks freed

Every session is a request of the same engine, so the engine's continuous batching puts all
their steps in one forward: a stream row is pushed for every session before the step, and no
session's decode waits for another's. The codec runs per session (each stream keeps its own
causal state), which is small next to the transformers. Greedy throughout, as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from omnistage.ar.engine import AREngine
from omnistage.ar.inputs import StreamInput
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig
from omnistage.models.moshi.engine_model import MoshiStepLM
from omnistage.models.moshi.mimi import MimiModel
from omnistage.models.moshi.mimi_layers import State
from omnistage.models.qwen3_omni.talker import FRAME_CODES
from omnistage.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TickOutput:
    """One session's answer to one tick."""
    text_id: int                 # the inner-monologue token
    text: str                    # its text ("" without a tokenizer, or for a special token)
    codes: Tensor | None         # (K,) Moshi's aligned frame; None at the tick it joined
    audio: Tensor | None         # (frame_size,) float32 waveform of that frame
    heard: bool                  # whether this tick consumed a frame (False: it joined)
    finished: bool = False       # the session used up the model's context


@dataclass(slots=True)
class _Session:
    encode_state: State = field(default_factory=dict)
    decode_state: State = field(default_factory=dict)
    prev_codes: Tensor | None = None   # c_f of the last step, (K,)
    prev_user: Tensor | None = None    # u_{r-1}, (K,)
    joined: bool = False               # prefilled


class MoshiDuplex:
    def __init__(self, path: str | Path, device: str = "cpu", dtype: str = "float32",
                 max_sessions: int = 8, block_size: int = 16) -> None:
        def load(folder: Path, dev: torch.device, dt: torch.dtype):
            model = MoshiStepLM.from_pretrained(folder, dev, dt)
            return model, model.model_config, None

        self.engine = AREngine(ARConfig(
            model=str(path), device=device, dtype=dtype, async_scheduling=False,
            kv_cache=KVCacheConfig(block_size=block_size, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=max_sessions)), loader=load)
        self.model: MoshiStepLM = self.engine.model
        self.cfg = self.model.cfg
        self.device = self.engine.device
        self.mimi = MimiModel.from_pretrained(path, "audio_encoder.", self.cfg.mimi,
                                              self.device, self.engine.dtype)
        self.max_sessions = max_sessions
        self.sessions: dict[str, _Session] = {}
        k, bos = self.cfg.num_codebooks, self.cfg.audio_vocab_size
        self._bos = torch.full((1, k), bos, dtype=torch.long, device=self.device)
        with torch.no_grad():
            text = torch.tensor([self.cfg.vocab_size], device=self.device)
            self._unconditional = (self.model.model.embed_tokens(text)
                                   + self.model.codes_embeds(self._bos, 0, k)
                                   + self.model.codes_embeds(self._bos, k, 2 * k))  # (1, H)
            self._owed = self.model.codes_embeds(self._bos[:, 1:], 1, k)            # (1, H)

    @property
    def frame_size(self) -> int:
        return self.cfg.mimi.frame_size

    @property
    def sample_rate(self) -> int:
        return self.cfg.mimi.sampling_rate

    @property
    def max_frames(self) -> int:
        """Ticks a session can last: the model's context less the unconditional frame."""
        return self.engine.max_model_len - 1

    def open(self, sid: str) -> None:
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already open")
        if len(self.sessions) >= self.max_sessions:
            raise ValueError(f"{self.max_sessions} sessions are open, the most this model "
                             "serves at once")
        params = SamplingParams(temperature=0.0, max_tokens=self.max_frames)
        self.engine.add_request(sid, None, params, prompt_embeds=self._unconditional,
                                stream=StreamInput(embeds=None, open=True))
        self.sessions[sid] = _Session()

    def close(self, sid: str) -> None:
        if self.sessions.pop(sid, None) is not None:
            self.engine.abort_request(sid)

    @torch.inference_mode()
    def tick(self, frames: dict[str, Tensor | None]) -> dict[str, TickOutput]:
        """One step of every open session. frames: each session's PCM frame (frame_size,)
        float, or None for silence (a session may be left out: it hears silence)."""
        k = self.cfg.num_codebooks
        heard = [sid for sid, s in self.sessions.items() if s.joined]
        if heard:
            users = torch.stack([self._encode(sid, frames.get(sid)) for sid in heard])
            prev = torch.stack([self._bos[0] if self.sessions[sid].prev_user is None
                                else self.sessions[sid].prev_user for sid in heard])
            fed = torch.cat([users[:, :1], prev[:, 1:]], 1)                    # (B, K)
            rows = self.model.codes_embeds(fed, k, 2 * k)                      # (B, H)
            for i, sid in enumerate(heard):
                s = self.sessions[sid]
                row = rows[i:i + 1] + (self._owed if s.prev_user is None else 0)
                s.prev_user = users[i]
                self.engine.extend_request(sid, stream_embeds=row.to(self.engine.dtype))
        outs = {o.request_id: o for o in self.engine.step()}
        result: dict[str, TickOutput] = {}
        for sid, s in list(self.sessions.items()):
            out = outs.get(sid)
            assert out is not None, f"session {sid!r} was not stepped with the others"
            if out.error is not None:
                raise RuntimeError(f"session {sid!r}: {out.error}")
            result[sid] = self._answer(sid, s, out.new_token_ids[-1], out.text_delta,
                                       out.extra[FRAME_CODES].reshape(-1, k)[-1], out.finished)
        return result

    def _encode(self, sid: str, frame: Tensor | None) -> Tensor:
        """One frame of a session's audio (None: silence) -> its user codes (K,)."""
        wav = (torch.zeros(self.frame_size) if frame is None else frame).to(
            self.device, self.engine.dtype)
        assert wav.shape == (self.frame_size,), (tuple(wav.shape), self.frame_size)
        codes = self.mimi.encode_step(wav.view(1, 1, -1), self.cfg.num_codebooks,
                                      self.sessions[sid].encode_state)
        return codes[0, :, 0]

    def _answer(self, sid: str, s: _Session, text_id: int, text: str, codes: Tensor,
                finished: bool) -> TickOutput:
        frame = audio = None
        was_joined = s.joined
        if s.prev_codes is not None:
            frame = torch.cat([s.prev_codes[:1], codes[1:]]).to(self.device)
            audio = self.mimi.decode_step(frame.view(1, -1, 1), s.decode_state)[0, 0].float()
            frame, audio = frame.cpu(), audio.cpu()
        s.prev_codes, s.joined = codes.cpu(), True
        if finished:
            self.sessions.pop(sid, None)
        return TickOutput(text_id, text, frame, audio, was_joined, finished)

