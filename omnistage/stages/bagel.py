"""BAGEL's AR stage: text answers from the understanding expert (models/bagel/understanding.py,
our Qwen2ForCausalLM on the AR engine). Its prompt ids come from the front door in the upstream
layout (models/bagel/processing.py); an answer ends at `<|im_end|>`, as the upstream's greedy
loop does, whatever stop ids the request names besides.

BagelThinkARStage (component bagel_und_think, graph bagel_think.yaml) is think mode's first
half: the upstream's GEN_THINK_SYSTEM_PROMPT segment goes before the prompt's, and its greedy
answer (the planning text) goes on to the diffusion stage along the edge und -> dit, where
BagelThinkPipeline adds it to the image's context."""

from __future__ import annotations

from dataclasses import replace

from transformers import AutoTokenizer

from omnistage.configs.schema import StageConfig
from omnistage.diffusion.image_input import image_files
from omnistage.errors import InputError
from omnistage.models.bagel.generate import GEN_THINK_SYSTEM_PROMPT
from omnistage.models.bagel.processing import BOS, EOS
from omnistage.models.bagel.understanding import load_understanding
from omnistage.models.loader import resolve_model_path
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageRequest


class BagelARStage(ARStage):
    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device, loader=load_understanding)
        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(stage.model or model)))
        self.bos, self.eos = tokenizer.convert_tokens_to_ids([BOS, EOS])
        self.tokenizer = tokenizer

    def prompt_ids(self, request: StageRequest) -> list[int]:
        return list(request.prompt_token_ids)

    def add(self, request: StageRequest) -> None:
        if request.streamed or not request.prompt_token_ids:
            raise ValueError("BAGEL's AR stage is an entry stage: it reads the prompt's ids")
        params = request.params or self.defaults
        if self.eos not in params.stop_token_ids:
            params = replace(params, stop_token_ids=(*params.stop_token_ids, self.eos))
        self.engine.add_request(request.request_id, self.prompt_ids(request), params)


class BagelThinkARStage(BagelARStage):
    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device)
        system = self.tokenizer(GEN_THINK_SYSTEM_PROMPT, add_special_tokens=False)["input_ids"]
        self.system = [self.bos, *system, self.eos]

    def prompt_ids(self, request: StageRequest) -> list[int]:
        image = request.diffusion.image if request.diffusion is not None else None
        if image is not None or image_files(request.multimodal):
            raise InputError("image: BAGEL's think mode plans from text only here (the "
                             "upstream's sees the input image); edit with bagel.yaml", "image")
        return [*self.system, *request.prompt_token_ids]
