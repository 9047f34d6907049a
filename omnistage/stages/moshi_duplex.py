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
session's decode waits for another's. The codec is batched too: each session owns a slot of
`MimiStreams`' pools (models/moshi/mimi_batch.py: its causal state, stacked on the batch
dimension), so a tick is one Mimi encode of every heard session, the engine's step, and one
Mimi decode of every speaking session; their codes and audio come back to the host in one
copy. On CUDA (`use_graphs`) the encode, the decode and the depth transformer replay CUDA
graphs per batch-size bucket. Greedy by default, as the reference; a session may sample its
text and its audio codes (`DuplexSampling`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from omnistage.ar.engine import AREngine
from omnistage.ar.inputs import StreamInput
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig
from omnistage.layers.graph_capture import RowGraphs, graph_batch_sizes
from omnistage.models.moshi.engine_model import AUDIO_TEMPERATURE, AUDIO_TOP_K, MoshiStepLM
from omnistage.models.moshi.mimi import MimiModel
from omnistage.models.moshi.mimi_batch import MimiStreams, StreamGraphs
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


@dataclass(frozen=True, slots=True)
class DuplexSampling:
    """A session's sampling: the inner monologue's text tokens and Moshi's audio codes, each a
    temperature (0: greedy, the default, as the golden reference) and a top-k (0: all); seed:
    the session's own RNG (None: the engine's). The released generation config samples:
    text 0.7 / top-k 25, audio 0.8 / top-k 250."""
    temperature: float = 0.0
    top_k: int = 0
    audio_temperature: float = 0.0
    audio_top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("temperature", self.temperature),
                            ("audio_temperature", self.audio_temperature)):
            if not 0.0 <= value <= 2.0:
                raise ValueError(f"{name}={value}: from 0 (greedy) to 2")
        for name, k in (("top_k", self.top_k), ("audio_top_k", self.audio_top_k)):
            if k < 0:
                raise ValueError(f"{name}={k}: 0 (all tokens) or more")

    def params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, seed=self.seed,
                              max_tokens=max_tokens,
                              extra={AUDIO_TEMPERATURE: self.audio_temperature,
                                     AUDIO_TOP_K: self.audio_top_k})


@dataclass(slots=True)
class _Session:
    slot: int                          # its row of the codec's pools and of the tables below
    has_heard: bool = False            # a frame was encoded (else u_{-1} = BOS is owed)
    joined: bool = False               # prefilled: its last step's codes are in `_prev_codes`


class MoshiDuplex:
    def __init__(self, path: str | Path, device: str = "cpu", dtype: str = "float32",
                 max_sessions: int = 8, block_size: int = 16, use_graphs: bool | None = None
                 ) -> None:
        """use_graphs: replay the codec's steps and the depth transformer from CUDA graphs
        (None: on CUDA only)."""
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
        with torch.inference_mode():
            text = torch.tensor([self.cfg.vocab_size], device=self.device)
            self._unconditional = (self.model.model.embed_tokens(text)
                                   + self.model.codes_embeds(self._bos, 0, k)
                                   + self.model.codes_embeds(self._bos, k, 2 * k))  # (1, H)
            self._owed = self.model.codes_embeds(self._bos[:, 1:], 1, k)            # (1, H)
            self._prev_user = self._bos.repeat(max_sessions, 1)     # u_{r-1} per slot (S, K)
            self._prev_codes = torch.zeros_like(self._prev_user)    # c_f of the last step
        self.streams = MimiStreams(self.mimi, max_sessions, k)
        self.encode_graphs: StreamGraphs | None = None     # set by `_capture_graphs`
        self.decode_graphs: StreamGraphs | None = None
        self._encode: Callable[[Tensor, Tensor], Tensor] = self.streams.encode
        self._decode: Callable[[Tensor, Tensor], Tensor] = self.streams.decode
        self._index_cache: dict[tuple[int, ...], Tensor] = {}
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """The encode, decode and depth steps as CUDA graphs of every batch-size bucket."""
        sizes = graph_batch_sizes(self.max_sessions)
        dt, k = self.engine.dtype, self.cfg.num_codebooks
        wav = torch.zeros(1, 1, self.frame_size, dtype=dt, device=self.device)
        codes = torch.zeros(1, k, 1, dtype=torch.long, device=self.device)
        encode = StreamGraphs(self.streams.encode, sizes, self.streams.scratch, wav)
        decode = StreamGraphs(self.streams.decode, sizes, self.streams.scratch, codes)
        hidden = torch.zeros(1, self.model.depth_decoder.cfg.input_size, dtype=dt,
                             device=self.device)
        text = torch.zeros(1, dtype=torch.long, device=self.device)
        run = self.model.depth_decoder.run_codebooks
        depth = RowGraphs(run, (hidden, text), self.max_sessions)
        vocab = self.model.depth_decoder.cfg.audio_vocab_size
        sampled = RowGraphs(run, (hidden, text, torch.ones(1, device=self.device),
                                  torch.zeros(1, dtype=torch.long, device=self.device),
                                  torch.ones(1, k, vocab, device=self.device)),
                            self.max_sessions)
        for graphs in (encode, decode, depth, sampled):
            graphs.capture_all()
        self.encode_graphs, self.decode_graphs = self._encode, self._decode = encode, decode
        self.model.depth_decoder.graphs = depth
        self.model.depth_decoder.sampled_graphs = sampled

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

    def open(self, sid: str, sampling: DuplexSampling | None = None) -> None:
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already open")
        if len(self.sessions) >= self.max_sessions:
            raise ValueError(f"{self.max_sessions} sessions are open, the most this model "
                             "serves at once")
        taken = {s.slot for s in self.sessions.values()}
        slot = next(i for i in range(self.max_sessions) if i not in taken)
        params = (sampling or DuplexSampling()).params(self.max_frames)
        self.engine.add_request(sid, None, params, prompt_embeds=self._unconditional,
                                stream=StreamInput(embeds=None, open=True))
        self.streams.reset(slot)
        with torch.inference_mode():
            self._prev_user[slot] = self._bos[0]
        self.sessions[sid] = _Session(slot)

    def close(self, sid: str) -> None:
        if self.sessions.pop(sid, None) is not None:
            self.engine.abort_request(sid)

    def _index(self, values: list[int]) -> Tensor:
        """A device tensor of `values`, kept: the sessions, hence the slots, change seldom."""
        key = tuple(values)
        if key not in self._index_cache:
            if len(self._index_cache) > 256:
                self._index_cache.clear()
            self._index_cache[key] = torch.tensor(key, dtype=torch.long, device=self.device)
        return self._index_cache[key]

    @torch.inference_mode()
    def tick(self, frames: dict[str, Tensor | None]) -> dict[str, TickOutput]:
        """One step of every open session. frames: each session's PCM frame (frame_size,)
        float, or None for silence (a session may be left out: it hears silence)."""
        heard = [sid for sid, s in self.sessions.items() if s.joined]
        if heard:
            self._hear(heard, frames)
        outs = {o.request_id: o for o in self.engine.step()}
        for sid in self.sessions:
            out = outs.get(sid)
            assert out is not None, f"session {sid!r} was not stepped with the others"
            if out.error is not None:
                raise RuntimeError(f"session {sid!r}: {out.error}")
        return self._answer(outs)

    def _hear(self, heard: list[str], frames: dict[str, Tensor | None]) -> None:
        """One Mimi encode of every heard session's frame (None: silence) -> its stream row."""
        k = self.cfg.num_codebooks
        wav = []
        for sid in heard:
            frame = frames.get(sid)
            wav.append(torch.zeros(self.frame_size) if frame is None else frame.float())
            assert wav[-1].shape == (self.frame_size,), (tuple(wav[-1].shape), self.frame_size)
        wav_dev = torch.stack(wav).to(self.device, self.engine.dtype)[:, None]   # (B, 1, N)
        slots = self._index([self.sessions[sid].slot for sid in heard])
        users = self._encode(slots, wav_dev)[:, :, 0]                               # (B, K)
        fed = torch.cat([users[:, :1], self._prev_user[slots][:, 1:]], 1)           # (B, K)
        rows = self.model.codes_embeds(fed, k, 2 * k).to(self.engine.dtype)         # (B, H)
        self._prev_user[slots] = users
        for i, sid in enumerate(heard):
            s = self.sessions[sid]
            row = rows[i:i + 1] if s.has_heard else rows[i:i + 1] + self._owed
            s.has_heard = True
            self.engine.extend_request(sid, stream_embeds=row.to(self.engine.dtype))

    def _answer(self, outs: dict) -> dict[str, TickOutput]:
        """One Mimi decode of every speaking session's aligned frame; every session's codes
        and audio read back in one copy."""
        k, order = self.cfg.num_codebooks, list(self.sessions.items())
        codes = torch.stack([outs[sid].extra[FRAME_CODES].reshape(-1, k)[-1]
                             for sid, _ in order]).to(self.device)                  # (N, K)
        spoke = [i for i, (_, s) in enumerate(order) if s.joined]
        row_of = {i: j for j, i in enumerate(spoke)}
        m = len(spoke)
        frames_cpu = audio_cpu = None
        if spoke:
            slots = self._index([order[i][1].slot for i in spoke])
            now = codes[self._index(spoke)] if m < len(order) else codes
            frames = torch.cat([self._prev_codes[slots][:, :1], now[:, 1:]], 1)     # (M, K)
            audio = self._decode(slots, frames[:, :, None])[:, 0]                  # (M, N)
            # the tick's one device-to-host copy (codes < 2^24: exact in float32)
            host = torch.cat([frames.flatten().float(), audio.flatten().float()]).cpu()
            frames_cpu = host[:m * k].long().view(m, k)
            audio_cpu = host[m * k:].view(m, self.frame_size)
        self._prev_codes[self._index([s.slot for _, s in order])] = codes
        result: dict[str, TickOutput] = {}
        for i, (sid, s) in enumerate(order):
            out, j = outs[sid], row_of.get(i)
            result[sid] = TickOutput(
                out.new_token_ids[-1], out.text_delta,
                None if j is None or frames_cpu is None else frames_cpu[j],
                None if j is None or audio_cpu is None else audio_cpu[j], s.joined,
                out.finished)
            s.joined = True
            if out.finished:
                self.sessions.pop(sid, None)
        return result
