"""Targets of tests/golden/ar/test_tensor_parallel.py, run on each rank by omnistage.testing.ranks
(or in the test process itself, with one rank, for the reference): every rank builds the same
AR engine over its shard of a tiny checkpoint; rank 0 serves requests arriving over several
steps and returns what they produced, the others follow its plans.

    serve_llm(ranks, path, waves, kv_bytes)   Qwen3 / Qwen2: tokens of every request
    serve_omni(ranks, path)                   Qwen3-Omni thinker (embeddings, multimodal
                                              positions, deepstack, hidden states) and talker
                                              (stream rows, fed-back code embeddings, codes)

A wave is (step, request id, prompt ids, max tokens): the request arrives before that step.
`graphs`: decode steps replayed from emulated CUDA graphs, with async scheduling
(graph_emulation.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from omnistage.ar.engine import AREngine
from omnistage.ar.inputs import MultimodalInput, StreamInput
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig
from omnistage.layers import graph_capture
from omnistage.layers.groups import StageRanks
from omnistage.sampling_params import SamplingParams
from omnistage.testing.graph_emulation import emulate_decode_graphs, rerun_capture

Wave = tuple[int, str, list[int], int]
BLOCK_SIZE = 4


def engine_config(path: str, kv_bytes: int, max_num_batched_tokens: int = 16) -> ARConfig:
    return ARConfig(model=path, device="cpu", dtype="float32",
                    kv_cache=KVCacheConfig(block_size=BLOCK_SIZE, cpu_kv_cache_bytes=kv_bytes),
                    scheduler=SchedulerConfig(max_num_seqs=8,
                                              max_num_batched_tokens=max_num_batched_tokens))


def serve(ranks: StageRanks, engine: AREngine, work: Callable[[], dict]) -> dict:
    """Rank 0 runs `work` and then stops the others; they follow until then. -> the KV
    layout every rank chose and its graph replays; rank 0's results; the plans a follower
    ran, by kind ("ahead": decode steps launched before the last one was read)."""
    layout, graphs = engine.kv_layout, engine.runner.graphs
    out: dict = {"num_blocks": layout.num_blocks, "num_kv_heads": layout.num_kv_heads,
                 "rank": ranks.rank}
    if not ranks.is_leader:
        out["plans"] = _follow_counted(engine)
    else:
        try:
            out.update(work())
        finally:
            engine.stop_followers()
    out["num_replays"] = 0 if graphs is None else graphs.num_replays
    return out


def _follow_counted(engine: AREngine) -> dict[str, int]:
    counts: dict[str, int] = {}
    follow = engine.runner.follow

    def counted(plan: object) -> None:
        kind = type(plan).__name__
        counts[kind] = counts.get(kind, 0) + 1
        if getattr(plan, "ahead", False):
            counts["ahead"] = counts.get("ahead", 0) + 1
        follow(plan)  # type: ignore[arg-type]

    engine.runner.follow = counted  # type: ignore[method-assign]
    engine.follow()
    return counts


def drive(engine: AREngine, waves: list[Wave], params: dict | None = None) -> dict:
    """Add each request before its step, step until all finish: -> {"tokens": {id: ids}}."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(w[0] for w in waves) or engine.has_unfinished_requests:
        for at, rid, prompt, max_tokens in waves:
            if at == step:
                engine.add_request(rid, prompt, SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **(params or {})))
                tokens[rid] = []
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
        step += 1
    return {"tokens": tokens}


def serve_llm(ranks: StageRanks, path: str, waves: list[Wave], kv_bytes: list[int],
              graphs: bool = False) -> dict:
    """kv_bytes: each rank's KV budget (the stage keeps the smallest)."""
    engine = AREngine(engine_config(path, kv_bytes[ranks.rank]))
    if graphs:
        graph_capture.capture_graph = rerun_capture     # this rank process's own
        emulate_decode_graphs(engine)
    return serve(ranks, engine, lambda: drive(engine, waves))


# -- Qwen3-Omni ------------------------------------------------------------------------------

def _omni_engine(path: str, part: str) -> AREngine:
    from omnistage.models.qwen3_omni.talker import Qwen3OmniTalkerForCausalLM
    from omnistage.models.qwen3_omni.thinker import Qwen3OmniThinkerForCausalLM

    cls = Qwen3OmniThinkerForCausalLM if part == "thinker" else Qwen3OmniTalkerForCausalLM

    def load(p: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
        model = cls.from_pretrained(p, device, dtype)
        return model, model.model_config, None

    return AREngine(engine_config(path, 1 << 20, max_num_batched_tokens=32), loader=load)


def thinker_work(engine: AREngine) -> dict:
    """A prompt embedded at arrival (outside a step), given back as embeddings with noise,
    multimodal positions and deepstack features, emitting hidden states; beside it a plain
    prompt arriving later."""
    gen = torch.Generator().manual_seed(0)
    hidden, num_layers = engine.model_config.hidden_size, engine.model_config.num_hidden_layers
    ids = [(7 * i + 5) % 300 for i in range(12)]
    embeds = engine.embed_input_ids(torch.tensor(ids))
    prompt = embeds + 0.5 * torch.randn(embeds.shape, generator=gen)
    positions = torch.arange(12).expand(3, 12).clone()
    positions[1, 3:9] = torch.tensor([3, 3, 4, 4, 5, 5])     # an image's rows and columns
    positions[2, 3:9] = torch.tensor([3, 4, 3, 4, 3, 4])
    deepstack = (torch.arange(3, 9), torch.randn(2, 6, hidden, generator=gen))
    mm = MultimodalInput(positions, -3, deepstack)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            output_hidden_layers=(0, 2, num_layers))
    engine.add_request("mm", ids, params, prompt, mm=mm)
    got: dict = {"embed": embeds.tolist(), "tokens": {"mm": [], "text": []}, "hidden": {}}
    step = 0
    while step < 2 or engine.has_unfinished_requests:
        if step == 1:
            engine.add_request("text", [9, 8, 7, 6, 5, 4, 3, 2, 1],
                               SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
        for o in engine.step():
            got["tokens"][o.request_id] += o.new_token_ids
            for layer, h in (o.hidden_states or {}).items():
                got["hidden"].setdefault(str(layer), []).extend(h.tolist())
        step += 1
    return got


def talker_work(engine: AREngine) -> dict:
    """Two talker requests: prompt embeddings, then decodes fed their codes' embeddings
    (the feedback hook) plus stream rows, then the stream's pad."""
    gen = torch.Generator().manual_seed(1)
    hidden = engine.model_config.hidden_size
    got: dict = {"tokens": {}, "codes": {}}
    for r, (num_prompt, num_stream) in enumerate([(7, 3), (4, 1)]):
        rid = f"t{r}"
        engine.add_request(rid, None, SamplingParams(temperature=0.0, max_tokens=6,
                                                     ignore_eos=True),
                           prompt_open=True, stream=StreamInput())
        engine.extend_request(rid, prompt_embeds=torch.randn(num_prompt, hidden, generator=gen),
                              close_prompt=True)
        engine.extend_request(rid, stream_embeds=torch.randn(num_stream, hidden, generator=gen),
                              close_stream=True, stream_pad=torch.randn(hidden, generator=gen))
        got["tokens"][rid], got["codes"][rid] = [], []
    while engine.has_unfinished_requests:
        for o in engine.step():
            got["tokens"][o.request_id] += o.new_token_ids
            if o.extra is not None:
                got["codes"][o.request_id].append(o.extra["codes"].tolist())
    return got


def serve_omni(ranks: StageRanks, path: str, graphs: bool = False) -> dict:
    """The thinker, then the talker, each built by every rank and served by rank 0."""
    if graphs:
        graph_capture.capture_graph = rerun_capture
    out = {}
    for part, work in (("thinker", thinker_work), ("talker", talker_work)):
        engine = _omni_engine(path, part)
        if graphs:
            emulate_decode_graphs(engine)
        out[part] = serve(ranks, engine, lambda e=engine, w=work: w(e))  # type: ignore[misc]
    return out
