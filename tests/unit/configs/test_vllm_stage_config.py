"""vLLM-Omni stage configs (tests/fixtures/vllm_omni/, in its grammar) translate to our shipped
graph of the family; every key is mapped, ignored with a reason, or refused with its path."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import yaml

from omnistage.configs.graph import load_graph
from omnistage.configs.parse import ConfigError, from_dict
from omnistage.configs.schema import GraphConfig
from omnistage.configs.vllm_stage_config import (
    load_stage_configs,
    stage_configs_yaml,
    translate,
)

FIXTURES = Path(__file__).parents[2] / "fixtures" / "vllm_omni"
CASES = [("qwen3_omni_moe.yaml", "qwen3_omni.yaml"), ("qwen3_tts.yaml", "qwen3_tts.yaml"),
         ("qwen_image.yaml", "qwen_image.yaml"), ("wan.yaml", "wan.yaml")]


def shipped(name: str) -> GraphConfig:
    return load_graph(resources.files("omnistage.configs").joinpath(name).read_text())


def shape(graph: GraphConfig) -> list[tuple]:
    return [(s.name, s.kind, s.component, s.final,
             [(i.source, i.adapter, i.chunked) for i in s.inputs]) for s in graph.stages]


@pytest.mark.parametrize("theirs,ours", CASES)
def test_translates_to_the_shipped_graph(theirs: str, ours: str) -> None:
    graph = load_graph(stage_configs_yaml(FIXTURES / theirs))
    want = shipped(ours)
    assert shape(graph) == shape(want)
    assert (graph.connector, graph.backend) == (want.connector, want.backend)
    for got, s in zip(graph.stages, want.stages):
        assert got.placement == s.placement, got.name
        if s.kind == "ar":
            assert got.ar.sampling == s.ar.sampling, got.name
            assert got.ar.kv_cache == s.ar.kv_cache, got.name
        assert (got.diffusion, got.generation) == (s.diffusion, s.generation), got.name


def test_engine_args_map_onto_the_stage() -> None:
    graph = from_dict(GraphConfig, load_stage_configs(FIXTURES / "qwen3_omni_moe.yaml"))
    thinker = graph.stage("thinker")
    assert thinker.ar.enforce_eager is True
    assert thinker.placement.memory_fraction == 0.75
    assert graph.stage("talker").ar.enforce_eager is False


def base() -> dict:
    return yaml.safe_load((FIXTURES / "qwen3_omni_moe.yaml").read_text())


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["stage_args"][0]["engine_args"].update(kv_transfer_config={}),
     "stage_args[0].engine_args.kv_transfer_config: not supported here"),
    (lambda d: d["stage_args"][0].update(colour=1),
     "stage_args[0].colour: not a stage key"),
    (lambda d: d["stage_args"][1]["runtime"].update(gpus=1),
     "stage_args[1].runtime.gpus: not a runtime key"),
    (lambda d: d["stage_args"][1].update(custom_process_input_func="x.y.mine"),
     "stage_args[1].custom_process_input_func: 'x.y.mine': no adapter"),
    (lambda d: d["stage_args"][2].update(engine_input_source=[0]),
     "stage_args[2].engine_input_source: [0]: code2wav reads ['talker']"),
    (lambda d: d["stage_args"][2].update(final_output_type="text"),
     "stage_args[2].final_output_type: 'text'"),
    (lambda d: d["stage_args"][1]["default_sampling_params"].update(beam=2),
     "stage_args[1].default_sampling_params.beam: not a sampling parameter"),
    (lambda d: d["stage_args"][2]["engine_args"].update(model_stage="vocoder"),
     "stage_args[2].engine_args.model_stage: 'vocoder'"),
    (lambda d: d["stage_args"].pop(), "needs its stages code2wav too"),
    (lambda d: [s["engine_args"].update(model_arch="Bagel") for s in d["stage_args"]],
     "model_arch: 'Bagel' is not a family served here"),
    (lambda d: d.update(extra=1), "f.extra: not a key"),
])
def test_refused_with_path_and_reason(edit, message: str) -> None:
    doc = base()
    edit(doc)
    with pytest.raises(ConfigError) as e:
        translate(doc, "f")
    assert message in str(e.value)


def test_not_a_stage_config() -> None:
    with pytest.raises(ConfigError, match="expected a vLLM-Omni stage config"):
        translate({"stages": []}, "f")
