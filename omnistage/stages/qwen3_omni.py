"""Qwen3-Omni as three stages of the runtime: what `Qwen3OmniMoeForConditionalGeneration.
generate(return_audio=True)` does in one process, split so that speech streams out while the
thinker is still writing.

    thinker (ar)   prompt (+ audio / image / video features) -> text; emits, per position,
                   its input embedding (layer 0) and the talker's `accept_hidden_layer`
    talker (ar)    prefill = the user turns (thinker embeddings / hidden states projected) +
                   the assistant opening (text, tts specials, the speaker's codec tokens);
                   every decode adds the next thinker token's projected embedding ("trailing
                   text"), then tts_eos, then tts_pad; each sampled code 0 runs the code
                   predictor for the frame's other codebooks (the model's feedback hook)
    code2wav (gen) codec frames -> 24 kHz audio, chunk by chunk, exactly the whole decode
                   (generation/code2wav.py)

The talker's input is built here (`TalkerStage.feed` records the thinker's rows, each step
hands them to the engine in one batch), not in an edge adapter: it needs the
talker's projections and codec embeddings. The edges pass tensors through unchanged.

With tensor parallelism (ar/engine.py) rank 0 alone runs what this file adds to the engines:
the encoders, the talker's input building and its code predictor (whole on every rank,
models/qwen3_omni/talker.py). The one split piece it calls outside a step, the thinker's
token embedding, goes through `AREngine.embed_input_ids`, which the other ranks join.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from omnistage.ar.inputs import MultimodalInput, StreamInput
from omnistage.configs.schema import StageConfig
from omnistage.models.qwen3_omni.mrope import mrope_positions
from omnistage.models.qwen3_omni.audio_encoder import AudioEncoder
from omnistage.models.qwen3_omni.multimodal import SpecialTokens
from omnistage.models.qwen3_omni.vision_encoder import VisionEncoder
from omnistage.models.qwen3_omni.code_predictor import CodePredictorGraphs
from omnistage.models.qwen3_omni.talker import FRAME_CODES, Qwen3OmniTalkerForCausalLM
from omnistage.models.qwen3_omni.thinker import Qwen3OmniThinkerForCausalLM
from omnistage.payloads import CodecFrames, HiddenRows, Payload, ThinkerPrompt, TokenDelta
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageRequest, StageResult
from omnistage.stages.talker import OmniTalkerStage, OmniThinkerStage, load_component
from omnistage.utils import trace
from omnistage.outputs import StageMetrics

logger = logging.getLogger(__name__)

DEFAULT_SPEAKER = "ethan"           # the reference's `speaker="Ethan"`
GRIDS = ("image_grid_thw", "video_grid_thw", "video_second_per_grid")   # the talker's M-RoPE


# ---- thinker --------------------------------------------------------------------------------

class ThinkerStage(OmniThinkerStage):
    """The thinker's AR engine plus its audio and vision encoders, run when a request brings
    multimodal features: their outputs replace the placeholder embeddings, the multimodal
    rotary positions and deepstack features ride with the prompt. Requests that go on to the
    talker emit layer 0 and `accept_hidden_layer`, and their first chunk carries the prompt ids,
    the thinker embeddings of the tts special tokens and the prompt's visual grids."""

    model_class = Qwen3OmniThinkerForCausalLM

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device)
        hf = self.engine.hf_config
        ids = torch.tensor([hf.tts_bos_token_id, hf.tts_eos_token_id, hf.tts_pad_token_id],
                           device=self.engine.device)
        with torch.inference_mode():   # every rank of a tensor-parallel stage, at start-up
            self.tts_embeds = self.engine.model.embed_input_ids(ids).float().cpu()   # (3, H)

    def special_tokens(self) -> SpecialTokens:
        return SpecialTokens.from_hf(self.engine.hf_config.thinker_config, self.engine.tokenizer)

    def encoders(self) -> tuple[type[torch.nn.Module], type[torch.nn.Module]]:
        return AudioEncoder, VisionEncoder

    def hidden_layers_for_talker(self) -> tuple[int, ...]:
        return (0, self.engine.hf_config.talker_config.accept_hidden_layer)

    def thinker_prompt(self, request: StageRequest) -> ThinkerPrompt:
        mm = request.multimodal or {}
        return ThinkerPrompt(list(request.prompt_token_ids or []), self.tts_embeds,
                             {k: v for k, v in mm.items() if k in GRIDS})


# ---- talker ---------------------------------------------------------------------------------

@dataclass(slots=True)
class _TalkerInput:
    """What the talker has received of one request from the thinker (thinker space)."""
    speaker_id: int
    prompt_ids: list[int] | None = None
    tts: Tensor | None = None                       # (3, H_thinker): tts_bos, tts_eos, tts_pad
    grids: dict[str, Tensor] = field(default_factory=dict)   # the prompt's visual grids
    embeds: list[Tensor] = field(default_factory=list)     # layer 0 rows, by position
    hidden: list[Tensor] = field(default_factory=list)     # accept_hidden_layer rows
    num_rows: int = 0
    generated: list[int] = field(default_factory=list)
    prefilled: bool = False
    num_streamed: int = 0                           # trailing-text rows sent as stream embeds
    added_time: float = field(default_factory=time.monotonic)
    rows_time: float | None = None                  # when the prompt's rows were all in


WARM_PROJECTION_ROWS = 512   # TalkerStage._warm_projections: prompts and batches up to this


@dataclass(frozen=True, slots=True)
class CodePredictorOptions:
    """A talker stage's `ar.options` (Qwen3-Omni's, Qwen3-TTS's)."""

    # on CUDA, replay the code predictor's rounds of a frame as one CUDA graph per batch-size
    # bucket (checked against eager at start-up)
    code_predictor_cuda_graphs: bool = True


def code_predictor_graphs(talker: torch.nn.Module, max_batch: int,
                          device: torch.device, dtype: torch.dtype) -> CodePredictorGraphs | None:
    """CUDA graphs for the talker's code predictor, if one frame replayed through them equals
    the eager run (greedy and sampled), every bucket then captured; otherwise None, and the
    predictor runs eagerly."""
    predictor = talker.code_predictor
    graphs = CodePredictorGraphs(predictor, max_batch, device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    past = torch.randn(2, predictor.embedding_dim, device=device, generator=gen).to(dtype)
    code0 = torch.randint(0, predictor.cfg.vocab_size, (2,), device=device, generator=gen)
    try:
        for greedy in (True, False):
            results = []
            for use in (None, graphs):
                predictor.graphs = use
                gens = [torch.Generator(device=device).manual_seed(i) for i in range(2)]
                results.append(talker.predict_codes(past, code0, greedy=greedy, generators=gens))
            (eager, _), (replayed, _) = results
            if not torch.equal(eager, replayed):
                raise RuntimeError(f"codes differ (greedy={greedy}): {eager.tolist()} vs "
                                   f"{replayed.tolist()}")
        graphs.capture_all()   # now, not in the first serving step of each bucket
    except Exception as exc:   # capture not possible here: keep the eager path
        logger.warning("code predictor runs without CUDA graphs: %s", exc)
        return None
    finally:
        predictor.graphs = None
    return graphs


class TalkerStage(OmniTalkerStage):
    """The talker's AR engine, fed by the thinker's chunks (see the module docstring). Emits
    the codec frames (num_code_groups codes each) of every step but the last, as the reference
    (its final code 0 is EOS, or the length limit cut it before the code predictor ran)."""

    Options = CodePredictorOptions

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device,
                         loader=load_component(Qwen3OmniTalkerForCausalLM))
        hf = self.engine.hf_config
        self.hf = hf
        self.talker_cfg = hf.talker_config
        self.accept_layer = self.talker_cfg.accept_hidden_layer
        self.speakers = {k.lower(): v for k, v in (self.talker_cfg.speaker_id or {}).items()}
        self.default_speaker = DEFAULT_SPEAKER
        self.mm_token_ids = {hf.thinker_config.audio_token_id, hf.thinker_config.image_token_id,
                             hf.thinker_config.video_token_id}
        self.inputs: dict[str, _TalkerInput] = {}
        self._fed: dict[str, bool] = {}     # request -> input closed; fed since the last step
        self._codec: dict[int, Tensor] = {}  # speaker id -> the assistant opening's codec rows
        # seconds from add to: its prompt handed to the engine, its prompt rows all received
        self._prompt_ready: dict[str, tuple[float, float | None]] = {}

    def prepare(self) -> None:
        stage = self.stage
        if not self.engine.ranks.is_leader:   # the code predictor and the projections run on
            return                            # rank 0 alone (they never communicate)
        if (self.engine.device.type == "cuda" and not stage.ar.enforce_eager
                and self.options.code_predictor_cuda_graphs):
            self.model.code_predictor.graphs = code_predictor_graphs(
                self.model, stage.ar.max_num_seqs, self.engine.device, self.engine.dtype)
        if self.engine.device.type == "cuda":
            self._warm_projections()

    @torch.inference_mode()
    def _warm_projections(self) -> None:
        """Run the text and hidden projections once at every row count a step can hand them
        (a prompt's text rows, the trailing rows of a batch): a shape's first run on a busy GPU
        took up to 7 ms in a serving step (allocator and GEMM set-up; traced at concurrency 8),
        in the way of every request's next frame."""
        p = self._p()
        width = self.engine.hf_config.talker_config.thinker_hidden_size   # prepare() runs in
        # ARStage.__init__, before this class sets its own fields
        rows = torch.zeros(WARM_PROJECTION_ROWS, width, device=p.device, dtype=p.dtype)
        for n in range(1, WARM_PROJECTION_ROWS + 1):
            self.model.project_text(rows[:n])
            self.model.project_hidden(rows[:n])
        torch.cuda.synchronize(p.device)

    def decode_graph_variant(self) -> tuple[tuple[int, ...], bool]:
        """Every decode is fed embeddings (trailing text added, the frame's codes fed back) and
        emits the stage's hidden layers (none in the shipped graphs)."""
        return self.stage.ar.output_hidden_layers, True

    @property
    def model(self) -> Qwen3OmniTalkerForCausalLM:
        return self.engine.model

    def add(self, request: StageRequest) -> None:
        params, speaker_id = self.resolve_speaker(request)
        self.engine.add_request(request.request_id, None, params, prompt_open=True,
                                stream=StreamInput())
        self.inputs[request.request_id] = _TalkerInput(speaker_id)

    def abort(self, request_id: str) -> None:
        self.inputs.pop(request_id, None)
        self._fed.pop(request_id, None)
        self._prompt_ready.pop(request_id, None)
        super().abort(request_id)

    def accepts(self, request_id: str) -> bool:
        return request_id in self.inputs

    def on_prompt(self, request_id: str, prompt: ThinkerPrompt) -> None:
        state = self.inputs[request_id]
        state.prompt_ids, state.tts, state.grids = (prompt.prompt_token_ids, prompt.tts_embeds,
                                                    prompt.grids)

    def on_rows(self, request_id: str, rows: HiddenRows) -> None:
        state = self.inputs[request_id]
        positions = rows.positions.tolist()
        assert positions[0] == state.num_rows, "thinker rows arrive in order, once each"
        state.embeds.extend(rows.layers[0].unbind(0))
        state.hidden.extend(rows.layers[self.accept_layer].unbind(0))
        state.num_rows += len(positions)
        if (state.rows_time is None and state.prompt_ids is not None
                and state.num_rows > len(state.prompt_ids)):
            state.rows_time = time.monotonic()

    def on_tokens(self, request_id: str, tokens: TokenDelta) -> None:
        self.inputs[request_id].generated.extend(tokens.token_ids)

    def mark_fed(self, request_id: str) -> None:
        self._fed.setdefault(request_id, False)

    def close_input(self, request_id: str) -> None:
        if request_id in self.inputs:
            self._fed[request_id] = True

    @torch.inference_mode()
    def _apply_input(self) -> list[StageResult]:
        """Hand the engine what the thinker sent since the last step: prefills once the prompt
        rows and the first generated token's row are in; then the trailing text rows, of all
        requests projected in one batch; at the end tts_eos, and tts_pad for ever after. A
        request whose input is unusable fails alone."""
        failed, streamed = [], []
        fed, self._fed = self._fed, {}
        w0 = time.time()
        for rid, closed in fed.items():
            state = self.inputs.get(rid)
            if state is None:
                continue
            try:
                rows = self._prepare(rid, state, closed)
            except Exception as exc:   # as a failing feed was: this request fails, not the stage
                failed.append(self.failed(rid, exc))
                continue
            if rows is not None:
                streamed.append((rid, rows))
        trace.span("talker.prepare", w0, requests=len(fed))
        if streamed:
            w0 = time.time()
            projected = self._project_text(torch.cat([r for _, r in streamed]))
            trace.span("talker.project", w0, rows=len(projected))
            for (rid, _), rows in zip(streamed, projected.split([len(r) for _, r in streamed])):
                self.engine.extend_request(rid, stream_embeds=rows)
        for rid, closed in fed.items():
            state = self.inputs.get(rid)
            if closed and state is not None:
                self._close(rid, state)
        return failed

    def _prepare(self, request_id: str, state: _TalkerInput, closed: bool) -> Tensor | None:
        """Prefill if due; the new trailing text rows (thinker space) to stream, if any."""
        if state.prompt_ids is None:
            return None
        num_prompt = len(state.prompt_ids)
        if not state.prefilled and (state.num_rows > num_prompt or closed):
            w0 = time.time()
            embeds, positions, delta = self._prefill(state)
            trace.span("talker.prefill", w0, request=request_id)
            state.prefilled = True
            state.num_streamed = num_prompt + 1
            rows_in = None if state.rows_time is None else state.rows_time - state.added_time
            self._prompt_ready[request_id] = (time.monotonic() - state.added_time, rows_in)
            self.engine.extend_request(
                request_id, prompt_embeds=embeds, close_prompt=True,
                mm=None if positions is None else MultimodalInput(positions, delta or 0))
        if state.prefilled and state.num_rows > state.num_streamed:
            rows = torch.stack(state.embeds[state.num_streamed:state.num_rows])
            state.num_streamed = state.num_rows
            return rows
        return None

    def _close(self, request_id: str, state: _TalkerInput) -> None:
        if state.prompt_ids is None:   # the thinker produced nothing usable
            self.engine.extend_request(request_id, close_prompt=True, close_stream=True)
        else:
            tts = self._project_text(state.tts)                             # (3, H)
            self.engine.extend_request(request_id, stream_embeds=tts[1:2], close_stream=True,
                                       stream_pad=tts[2])
        self.inputs.pop(request_id, None)

    def _project_text(self, rows: Tensor) -> Tensor:
        p = next(self.model.parameters())
        if p.device.type == "cuda" and rows.device.type == "cpu":   # pinned: no wait; the host
            # goes on to launch the step
            rows = rows.pin_memory().to(p.device, non_blocking=True)
        return self.model.project_text(rows.to(p.device, p.dtype))

    def _prefill(self, state: _TalkerInput) -> tuple[Tensor, Tensor | None, int | None]:
        """The reference's talker prompt: user turns, then the assistant opening (9 rows);
        with visual inputs, its multimodal rotary positions (over the user turns' ids and
        tts_pad ids for the opening, as the reference computes them)."""
        cfg, hf = self.talker_cfg, self.hf
        ids = state.prompt_ids
        embeds = torch.stack(state.embeds)                                  # (rows, H_thinker)
        hidden = torch.stack(state.hidden)
        # user turns: every position whose turn (the token after the last <|im_start|>) is user
        parts = []
        role = None
        for i, tok in enumerate(ids):
            if tok == hf.im_start_token_id and i + 1 < len(ids):
                role = ids[i + 1]
            if role == hf.user_token_id:
                parts.append((i, tok in self.mm_token_ids))
        starts = [i for i in range(len(ids) - 1)
                  if ids[i] == hf.im_start_token_id and ids[i + 1] == hf.assistant_token_id]
        if not starts:
            raise ValueError("the prompt has no assistant turn (<|im_start|>assistant): the "
                             "talker speaks the assistant's answer")
        a = starts[-1]
        # every text row in one projection (one copy to the device): the user turn's text
        # positions, the assistant opening (3 prompt rows + the 1st token), tts bos/eos/pad
        text_pos = [i for i, is_mm in parts if not is_mm]
        tts = state.tts.to(embeds.device)     # rows come from a connector (host) or directly
        projected = self._project_text(torch.cat([embeds[text_pos], embeds[a:a + 4], tts]))
        user, assistant, tts = projected.split([len(text_pos), 4, 3])
        mm_pos = [k for k, (_, is_mm) in enumerate(parts) if is_mm]
        if mm_pos:   # multimodal positions take the hidden states instead
            p = self._p()
            text_k = [k for k, (_, is_mm) in enumerate(parts) if not is_mm]
            order = torch.tensor(mm_pos + text_k).to(p.device)
            mm = self.model.project_hidden(hidden[[parts[k][0] for k in mm_pos]].to(p.device,
                                                                                  p.dtype))
            both = torch.cat([mm, user])
            user = torch.empty_like(both).index_copy_(0, order, both)
        text = torch.cat([assistant[:3], tts[2:3].expand(4, -1), tts[0:1], assistant[3:4]])
        codec = self._codec_rows(state.speaker_id)[:text.shape[0]]          # (9, H)
        embeds = torch.cat([user, text + codec])
        if not state.grids:
            return embeds, None, None
        talker_ids = [ids[i] for i, _ in parts] + [hf.tts_pad_token_id] * text.shape[0]
        positions, delta = mrope_positions(
            torch.tensor(talker_ids), image_token_id=cfg.image_token_id,
            video_token_id=cfg.video_token_id, spatial_merge_size=cfg.spatial_merge_size,
            position_id_per_seconds=cfg.position_id_per_seconds,
            image_grid_thw=state.grids.get("image_grid_thw"),
            video_grid_thw=state.grids.get("video_grid_thw"),
            video_second_per_grid=state.grids.get("video_second_per_grid"),
            audio_token_id=cfg.audio_token_id,        # a video's audio track in the prompt
            audio_start_token_id=cfg.audio_start_token_id)
        return embeds, positions, int(delta)

    def _p(self) -> Tensor:
        return next(self.model.parameters())

    def _codec_rows(self, speaker_id: int) -> Tensor:
        """The assistant opening's codec side (9, H): 3 zero rows, then nothink, think_bos,
        think_eos, the speaker, pad, bos; computed once per speaker."""
        rows = self._codec.get(speaker_id)
        if rows is None:
            cfg = self.talker_cfg
            ids = torch.tensor([cfg.codec_nothink_id, cfg.codec_think_bos_id,
                                cfg.codec_think_eos_id, speaker_id, cfg.codec_pad_id,
                                cfg.codec_bos_id], device=self._p().device)
            emb = self.model.embed_input_ids(ids)   # the codec embedding is whole: rank 0 alone
            rows = self._codec[speaker_id] = torch.cat([emb.new_zeros(3, emb.shape[1]), emb])
        return rows

    def step(self) -> list[StageResult]:
        w0 = time.time()
        results = self._apply_input()
        trace.span("talker.apply_input", w0)
        outs = self.engine.step()
        w0 = time.time()
        for out in outs:
            payload = Payload()
            codes = None if out.extra is None else out.extra[FRAME_CODES]
            if codes is not None and int(codes[0]) not in self.engine.eos_token_ids:
                payload.codec = CodecFrames(codes.reshape(1, -1).cpu())    # (1, G)
            metrics = None
            if out.metrics is not None:
                ready, rows = self._prompt_ready.pop(out.request_id, (None, None))
                metrics = StageMetrics(queue_time=out.metrics.queue_time,
                                       prompt_ready_time=ready, prompt_rows_time=rows,
                                       num_prompt_tokens=out.metrics.num_prompt_tokens,
                                       num_preemptions=out.metrics.num_preemptions)
            results.append(StageResult(
                out.request_id, out.new_token_ids, "", payload, out.finished,
                out.finish_reason.value if out.finish_reason else None, out.error,
                engine_metrics=metrics))
            if out.finished:
                self.inputs.pop(out.request_id, None)
                self._prompt_ready.pop(out.request_id, None)
        trace.span("talker.results", w0)
        return results


def build_stage(stage: StageConfig, model: str, device: str) -> ARStage:
    if stage.component == "qwen3_omni_thinker":
        return ThinkerStage(stage, model, device)
    return TalkerStage(stage, model, device)
