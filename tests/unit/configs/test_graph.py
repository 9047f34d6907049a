"""Graph-level validation and queries: names, edges, cycles, adapters, finals, needed stages."""

from __future__ import annotations

import pytest

from omnistage.configs.graph import (downstream, entry_stages, find_cycle, load_graph,
                                     stages_needed, topological_order, validate_graph)
from omnistage.configs.parse import ConfigError, from_dict
from omnistage.configs.schema import GraphConfig
from omnistage.stages import adapters
from omnistage.stages.adapters import register_adapter

QWEN3_OMNI = """\
stages:
  - {name: thinker, kind: ar, component: thinker, final: text,
     ar: {sampling: {temperature: 0.0, max_tokens: 2048}}}
  - name: talker
    kind: ar
    component: talker
    inputs: [{from: thinker, adapter: test.thinker_to_talker, chunked: true}]
    ar:
      output_hidden_layers: [0]
  - name: code2wav
    kind: generation
    inputs: [{from: talker, adapter: test.talker_to_code2wav, chunked: true}]
    final: audio
"""


@pytest.fixture(autouse=True)
def test_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A private registry holding throwaway adapters; the real one is restored afterwards."""
    monkeypatch.setattr(adapters, "ADAPTERS", {})
    for name in ("test.thinker_to_talker", "test.talker_to_code2wav", "test.identity"):
        register_adapter(name)(lambda output, name=name: (name, output))


def edge(source: str, adapter: str = "test.identity") -> dict:
    return {"from": source, "adapter": adapter}


def graph(*stages: dict) -> GraphConfig:
    """A graph from short stage dicts, kind ar unless given: {"name": "b", "inputs": [...]}."""
    return from_dict(GraphConfig, {"stages": [{"kind": "ar", **s} for s in stages]})


def invalid(g: GraphConfig) -> str:
    """The ConfigError of `g`, adapters checked against the (test) registry."""
    with pytest.raises(ConfigError) as info:
        validate_graph(g, adapters=adapters.ADAPTERS)
    return str(info.value)


# ---- a valid graph -----------------------------------------------------------------------------

def test_qwen3_omni_graph_is_valid_and_answers_queries() -> None:
    g = load_graph(QWEN3_OMNI)
    validate_graph(g)
    assert topological_order(g) == ["thinker", "talker", "code2wav"]
    assert entry_stages(g) == ["thinker"]
    assert find_cycle(g) is None
    assert [(s.name, i.adapter) for s, i in downstream(g, "thinker")] == [
        ("talker", "test.thinker_to_talker")]
    assert downstream(g, "code2wav") == []
    with pytest.raises(ConfigError, match="no stage named 'talkr' \\(did you mean talker\\?\\)"):
        downstream(g, "talkr")


def test_stages_needed_depends_on_the_requested_outputs() -> None:
    g = load_graph(QWEN3_OMNI)
    assert stages_needed(g, {"text"}) == {"thinker"}
    assert stages_needed(g, {"audio"}) == {"thinker", "talker", "code2wav"}
    assert stages_needed(g, {"text", "audio"}) == {"thinker", "talker", "code2wav"}
    assert stages_needed(g, set()) == set()
    with pytest.raises(ValueError, match=r"no stage produces image \(this graph produces: "
                                         r"text \(thinker\), audio \(code2wav\)\)"):
        stages_needed(g, {"text", "image"})


def test_load_graph_applies_overrides_then_validates() -> None:
    g = load_graph(QWEN3_OMNI, ["talker.placement.memory_fraction=0.2", "connector=inproc"])
    assert g.stage("talker").placement.memory_fraction == 0.2 and g.connector == "inproc"
    with pytest.raises(ConfigError, match=r"^stages\[2\]\.inputs\[0\]\.from: stage 'code2wav' "
                                          r"reads its own output"):
        load_graph(QWEN3_OMNI, ["code2wav.inputs.0.from=code2wav"])


def test_topological_order_follows_edges_not_declaration() -> None:
    # diamond, declared backwards: a -> (b, c) -> d
    g = graph({"name": "d", "inputs": [edge("c"), edge("b")], "final": "text"},
              {"name": "c", "inputs": [edge("a")]},
              {"name": "b", "inputs": [edge("a")]},
              {"name": "a"})
    validate_graph(g)
    assert topological_order(g) == ["a", "c", "b", "d"]
    assert entry_stages(g) == ["a"]
    assert stages_needed(g, {"text"}) == {"a", "b", "c", "d"}
    assert {s.name for s, _ in downstream(g, "a")} == {"b", "c"}


def test_two_entry_stages_are_allowed() -> None:
    g = graph({"name": "vision"}, {"name": "audio_in"},
              {"name": "llm", "inputs": [edge("vision"), edge("audio_in")], "final": "text"})
    validate_graph(g)
    assert entry_stages(g) == ["vision", "audio_in"]


# ---- names and edges ---------------------------------------------------------------------------

def test_stage_names_must_be_unique() -> None:
    g = graph({"name": "a", "final": "text"}, {"name": "b", "inputs": [edge("a")]},
              {"name": "a", "inputs": [edge("b")]})
    assert invalid(g) == "stages[2].name: 'a' is already the name of stages[0]"


def test_input_must_name_an_existing_stage_with_a_hint() -> None:
    g = graph({"name": "thinker", "final": "text"},
              {"name": "talker", "inputs": [edge("thinkr")], "final": "audio"})
    assert invalid(g) == ("stages[1].inputs[0].from: no stage named 'thinkr' (did you mean "
                          "thinker?) (stages: thinker, talker)")


def test_self_loop_and_repeated_input_are_rejected() -> None:
    g = graph({"name": "a", "inputs": [edge("a")], "final": "text"})
    assert invalid(g) == "stages[0].inputs[0].from: stage 'a' reads its own output (self-loop)"
    g = graph({"name": "a"}, {"name": "b", "inputs": [edge("a"), edge("a")], "final": "text"})
    assert invalid(g) == "stages[1].inputs[1].from: 'a' is already an input of 'b'"


def test_two_stage_cycle_is_named() -> None:
    g = graph({"name": "a", "final": "text"},
              {"name": "b", "inputs": [edge("a"), edge("c")]},
              {"name": "c", "inputs": [edge("b")]})
    assert invalid(g) == "stages: cycle: b -> c -> b"
    assert find_cycle(g) == ["b", "c", "b"]
    with pytest.raises(ConfigError, match=r"cycle: b -> c -> b"):
        topological_order(g)


def test_three_stage_cycle_is_named() -> None:
    g = graph({"name": "a", "final": "text"},
              {"name": "b", "inputs": [edge("a"), edge("d")]},
              {"name": "c", "inputs": [edge("b")]},
              {"name": "d", "inputs": [edge("c")], "final": "audio"})
    assert invalid(g) == "stages: cycle: b -> c -> d -> b"


def test_graph_that_is_only_a_cycle_is_named() -> None:
    g = graph({"name": "a", "inputs": [edge("b")], "final": "text"},
              {"name": "b", "inputs": [edge("a")]})
    assert invalid(g) == "stages: cycle: a -> b -> a"


def test_adapter_must_be_registered() -> None:
    g = load_graph(QWEN3_OMNI, ["talker.inputs.0.adapter=test.thinker_to_talkr"])
    msg = invalid(g)
    assert msg.startswith("stages[1].inputs[0].adapter: 'test.thinker_to_talkr' is not "
                          "registered (did you mean test.thinker_to_talker?) (known: "
                          "test.identity, test.talker_to_code2wav, test.thinker_to_talker;")
    assert "stage 'talker'" in msg
    validate_graph(g)                               # no registry given: names not checked


def test_registered_adapter_is_found_in_the_live_registry() -> None:
    g = graph({"name": "a"}, {"name": "b", "inputs": [edge("a", "test.late")], "final": "text"})
    assert "'test.late' is not registered" in invalid(g)
    register_adapter("test.late")(lambda output: output)
    validate_graph(g, adapters=adapters.ADAPTERS)


# ---- outputs and kinds -------------------------------------------------------------------------

def test_graph_needs_a_final_stage() -> None:
    g = graph({"name": "a"}, {"name": "b", "inputs": [edge("a")]})
    assert invalid(g) == ("stages: no final stage (set `final: text|audio|...` on the stage "
                          "whose output goes to the client)")
    assert invalid(GraphConfig(stages=())) == "stages: at least one stage is required"


def test_every_stage_output_must_go_somewhere() -> None:
    g = graph({"name": "a", "final": "text"}, {"name": "b", "inputs": [edge("a")]})
    assert invalid(g) == ("stages[1]: the output of 'b' goes nowhere (no `final` and no stage "
                          "reads it)")


def test_one_final_stage_per_output_kind() -> None:
    g = graph({"name": "a", "final": "text"},
              {"name": "b", "inputs": [edge("a")], "final": "text"})
    assert invalid(g) == "stages[1].final: 'text' is already the final output of stage 'a'"


def test_hidden_layers_and_sampling_only_on_ar_stages() -> None:
    """They live in the `ar` record, which a stage of another kind refuses."""
    base = {"name": "a", "final": "text"}
    with pytest.raises(ConfigError, match=r"^stages\[1\]\.ar: settings of ar stages; stage "
                                          "'v' is of kind generation"):
        graph(base, {"name": "v", "kind": "generation", "inputs": [edge("a")], "final": "audio",
                     "ar": {"output_hidden_layers": [1]}})
    with pytest.raises(ConfigError, match=r"^stages\[1\]\.sampling: moved to "
                                          r"stages\[1\]\.ar\.sampling"):
        graph(base, {"name": "v", "kind": "diffusion", "inputs": [edge("a")], "final": "image",
                     "sampling": {"temperature": 0.5}})

