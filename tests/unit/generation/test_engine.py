"""The generation engine with a model that keeps a backlog (a per-call budget, as code2wav's
frame budget): requests are stepped again without new input, finish only once the backlog is
drained, and produce results only when they have output or finish."""

from __future__ import annotations

import torch
from torch import Tensor

from omnistage.generation.engine import GenerationEngine


class Budgeted:
    """Echoes its input rows, at most `budget` rows per call over all requests (FIFO)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.calls: list[list[int]] = []      # per call: rows emitted per request

    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]:
        left, outs, sizes = self.budget, [], []
        for x, state in zip(inputs, states):
            queue = state.setdefault("queue", [])
            if "x" in x:
                queue.extend(x["x"].tolist())
            take, state["queue"] = queue[:left], queue[left:]
            left -= len(take)
            sizes.append(len(take))
            outs.append({"x": torch.tensor(take)} if take else {})
        self.calls.append(sizes)
        return outs

    def has_backlog(self, state: dict) -> bool:
        return bool(state.get("queue"))


def test_backlog_is_drained_before_finishing() -> None:
    model = Budgeted(budget=3)
    engine = GenerationEngine(model)
    engine.add_request("a")
    engine.add_request("b")
    engine.feed("a", {"x": torch.arange(5)}, close=True)
    engine.feed("b", {"x": torch.arange(10, 12)}, close=False)
    got: dict[str, list[int]] = {"a": [], "b": []}
    finished: list[str] = []
    for _ in range(10):
        for r in engine.step():
            assert r.tensors or r.finished, "a result without output or finish"
            got[r.request_id] += r.tensors["x"].tolist() if r.tensors else []
            if r.finished:
                finished.append(r.request_id)
        if not engine.has_unfinished_requests:
            break
        if len(model.calls) == 2:
            engine.feed("b", None, close=True)
    assert got == {"a": [0, 1, 2, 3, 4], "b": [10, 11]}
    assert finished == ["a", "b"]
    # call 1: a takes the budget, b waits; call 2: a's backlog (no new input), then b
    assert model.calls[:2] == [[3, 0], [2, 1]]


def test_idle_requests_are_not_stepped() -> None:
    model = Budgeted(budget=4)
    engine = GenerationEngine(model)
    engine.add_request("a")
    assert engine.step() == [] and model.calls == []   # no input, no backlog: no call
    engine.feed("a", {"x": torch.arange(2)}, close=False)
    (r,) = engine.step()
    assert r.tensors["x"].tolist() == [0, 1] and not r.finished
    assert engine.step() == []                          # nothing new: no call, no result
    assert len(model.calls) == 1


class Fragile(Budgeted):
    """Budgeted, but a batch holding the row value 666 raises (after changing the states, as
    code2wav's append does before its forward), and the row value 777 comes out as NaN."""

    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]:
        outs = super().generate(inputs, states, is_last)
        if any(666 in out.get("x", torch.tensor([])).tolist() for out in outs):
            raise RuntimeError("poisoned input")
        return [{"x": torch.where(o["x"] == 777, float("nan"), o["x"].float())} if o else o
                for o in outs]


def test_a_poisoned_request_fails_alone_and_the_others_keep_their_state() -> None:
    """A call that raises is made again per request from the states before it, so the others
    get their rows exactly once; an output with NaN fails its request alone."""
    engine = GenerationEngine(Fragile(budget=100))
    feeds = {"a": [1, 2], "raises": [3, 666], "b": [4, 5, 6], "nan": [777]}
    for rid, rows in feeds.items():
        engine.add_request(rid)
        engine.feed(rid, {"x": torch.tensor(rows)}, close=True)
    results = {r.request_id: r for r in engine.step()}
    assert "poisoned input" in str(results["raises"].error)
    assert "holds inf or NaN" in str(results["nan"].error)
    assert results["a"].tensors["x"].tolist() == [1, 2] and results["a"].finished
    assert results["b"].tensors["x"].tolist() == [4, 5, 6] and results["b"].finished
    assert not engine.has_unfinished_requests
