"""A stand-in for AsyncOmni with what the OpenAI server uses of it: one text stage that
answers "ok" at once. For route tests that need the app in process and no model.

    FakeTextEngine(tmp_path)                         a text model, max_model_len 64
    FakeTextEngine(tmp_path, processor=object())     takes media parts, as Qwen3-Omni does
    FakeTextEngine(tmp_path, speech=SpeechSpec(...)) a speech model
    FakeTextEngine(tmp_path, max_model_len=None)     a stage that reports no maximum length
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from omnistage.configs.schema import GraphConfig, StageConfig
from omnistage.engine.inputs import ParsedPrompt, parse_prompt
from omnistage.engine.request import OmniRequest
from omnistage.outputs import OmniOutput, RequestEvent, RequestMetrics
from omnistage.registry import SpeechSpec
from omnistage.stages.info import StageInfo
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer


class FakeTextEngine:
    """Counts its `prepare` calls (`num_prepared`): a test can see what was tokenized."""

    def __init__(self, tokenizer_dir: Path, *, processor: object | None = None,
                 speech: SpeechSpec | None = None, max_model_len: int | None = 64,
                 chat_template: str | None = None) -> None:
        self.graph = GraphConfig(stages=(StageConfig(name="llm", kind="ar", final="text"),))
        self.tokenizer = build_tiny_tokenizer(tokenizer_dir)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        self.processor = processor
        self.entry, self.text_entry, self.is_healthy = ["llm"], False, True
        self.audio_sample_rate, self.speech, self.video = None, speech, None
        info = StageInfo(max_model_len=max_model_len)
        self.orchestrator = SimpleNamespace(stage_info={"llm": info}, dead_reason=None,
                                            degraded_reason=None,
                                            stage_stats=lambda timeout: {},
                                            replica_status=lambda: {})
        self.num_prepared = 0

    def prepare(self, request: OmniRequest) -> tuple[ParsedPrompt, dict]:
        self.num_prepared += 1
        return parse_prompt(request.prompt, self.tokenizer), {"llm": request.params[0]}

    def add_request(self, request: OmniRequest, sink, prepared) -> OmniOutput:
        request_id = request.request_id
        out = OmniOutput(request_id, "", [], metrics=RequestMetrics(arrival_time=time.time()))
        sink(RequestEvent(request_id, "llm", [5], "ok", stage_finished=True,
                          finish_reason="stop", done=True, stage_metrics={}))
        return out

    def abort(self, request_id: str) -> None:
        pass
