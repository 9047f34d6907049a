"""ShapeGraphs: which calls capture, which replay, and that a replay reads its new inputs
(CPU: the capture stand-in reruns the function on the graph's input buffers)."""

from __future__ import annotations

import pytest
import torch

from omnistage.layers import graph_capture
from omnistage.layers.graph_capture import ShapeGraphs
from omnistage.testing.graph_emulation import rerun_capture


@pytest.fixture(autouse=True)
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)


def scaled(x: torch.Tensor, mask: torch.Tensor | None, shapes: list, scale: float = 2.0
           ) -> torch.Tensor:
    out = x * scale + len(shapes)
    return out if mask is None else out * mask


def test_second_call_of_a_signature_captures_then_replays_new_inputs() -> None:
    calls = []

    def fn(*args, **kwargs):
        calls.append(1)
        return scaled(*args, **kwargs)

    graphs = ShapeGraphs(fn, max_graphs=2)
    for i in range(4):                       # eager, capture (warm-up + record), 2 replays
        x = torch.full((2, 3), float(i))
        assert torch.equal(graphs(x, None, shapes=[[1, 2]]), x * 2 + 1)
    assert len(graphs.graphs) == 1 and graphs.num_replays == 3
    out = graphs(torch.ones(2, 3), None, shapes=[[1, 2]])
    out += 100                               # the caller's copy: the graph's output stays
    assert torch.equal(graphs(torch.ones(2, 3), None, shapes=[[1, 2]]), torch.full((2, 3), 3.))


def test_signatures_differ_by_shape_dtype_none_and_values() -> None:
    graphs = ShapeGraphs(scaled, max_graphs=3)
    x, m = torch.ones(2, 3), torch.tensor([[1.0, 0.0, 1.0]] * 2)
    variants = [((x, None), {"shapes": [1]}), ((x, m), {"shapes": [1]}),
                ((x, None), {"shapes": [1, 1]}), ((torch.ones(3, 3), None), {"shapes": [1]}),
                ((x, None), {"shapes": [1], "scale": 3.0})]
    for _ in range(2):
        for args, kwargs in variants:
            assert torch.equal(graphs(*args, **kwargs), scaled(*args, **kwargs))
    assert len(graphs.graphs) == 3                 # max_graphs: the others stay eager
    assert len(graphs.seen) == 5


def test_tensors_inside_lists_are_refused() -> None:
    with pytest.raises(TypeError, match="pass each tensor as an argument"):
        ShapeGraphs(lambda xs: xs[0])([torch.ones(1)])
