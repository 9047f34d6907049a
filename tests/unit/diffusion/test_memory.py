"""A diffusion stage's memory budget (diffusion/memory.py) on the CPU: a byte model of a
device stands in for CUDA's counters, and the digits pipeline "allocates" a fixed number of
bytes per batch row in each step. Admission batches only what fits, a request too large
alone is refused, the rest wait and run later, and an out-of-memory step fails only its own
requests."""

from __future__ import annotations

import pytest
import torch

from omnistage.diffusion.engine import DiffusionEngine, DiffusionResult
from omnistage.diffusion.memory import ActivationFit, MemoryBudget
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.digits import DigitsPipeline
from omnistage.errors import InputError
from omnistage.models.digits_dit import DigitsDiT, DigitsDiTConfig

MIB = 2**20
HELD = 100 * MIB            # weights: allocated before any step
ROW = MIB                   # what one batch row's activations take in a step


class ByteDevice:
    """A device of `capacity` bytes read through the MemoryProbe calls; `allocate` is a
    step's activations, out of memory above the capacity or while `fail_next` lasts."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.max_seen = HELD
        self.fail_next = 0
        self.num_frees = 0

    def total(self) -> int:
        return self.capacity

    def allocated(self) -> int:
        return HELD

    def reset_peak(self) -> None:
        self.max_seen = HELD

    def peak(self) -> int:
        return self.max_seen

    def free_cache(self) -> None:
        self.num_frees += 1

    def allocate(self, nbytes: int) -> None:
        if self.fail_next or HELD + nbytes > self.capacity:
            self.fail_next = max(0, self.fail_next - 1)
            raise torch.OutOfMemoryError(f"Tried to allocate {nbytes / MIB:.1f} MiB")
        self.max_seen = max(self.max_seen, HELD + nbytes)


class Metered:
    """The digits pipeline whose steps allocate ROW bytes per row (`hogs`: ten times that)
    on a ByteDevice, and which notes the rows of every forward."""

    def __init__(self, inner: DigitsPipeline, device: ByteDevice, hogs: set[str] = frozenset()
                 ) -> None:
        self.inner, self.memory, self.hogs = inner, device, hogs
        self.rows: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def velocity(self, latents: torch.Tensor, sigmas: torch.Tensor, requests: list
                 ) -> torch.Tensor:
        rows = [r.latents.shape[0] * (10 if r.request_id in self.hogs else 1) for r in requests]
        self.memory.allocate(sum(rows) * ROW)
        self.rows.append(latents.shape[0])
        return self.inner.velocity(latents, sigmas, requests)


@pytest.fixture(scope="module")
def digits() -> DigitsPipeline:
    torch.manual_seed(0)
    return DigitsPipeline(DigitsDiT(DigitsDiTConfig(hidden_size=32, num_layers=1, num_heads=2)),
                          torch.device("cpu"))


def budgeted(digits: DigitsPipeline, room_rows: float, hogs: set[str] = frozenset(),
             profile: bool = True) -> tuple[DiffusionEngine, Metered, ByteDevice]:
    """An engine whose budget leaves room for `room_rows` rows of a step (the device itself
    holds that much more: only a hog runs it out)."""
    device = ByteDevice(HELD + int(room_rows * ROW))
    pipe = Metered(digits, device, hogs)
    engine = DiffusionEngine(pipe, max_num_seqs=8,
                             memory=MemoryBudget(device, HELD + int(room_rows * ROW)))
    if profile:
        engine.profile_memory()
        pipe.rows.clear()
    return engine, pipe, device


def run(engine: DiffusionEngine) -> dict[str, DiffusionResult]:
    done = {}
    for _ in range(200):
        if not engine.has_unfinished_requests:
            return done
        done.update({r.request_id: r for r in engine.step() if r.finished})
    raise AssertionError("the engine did not finish its requests in 200 steps")


def alone(digits: DigitsPipeline, rid: str, params: DiffusionParams) -> torch.Tensor:
    engine = DiffusionEngine(digits)
    engine.add_request(rid, "a 5", params)
    return run(engine)[rid].images


def test_steps_take_only_what_fits_and_the_rest_run_later(digits: DigitsPipeline) -> None:
    """Room for 3.5 rows (3 with the budget's headroom): six requests of seven rows run in
    steps of at most 3 rows, each ending as it does alone."""
    engine, pipe, _ = budgeted(digits, room_rows=3.5)
    params = {f"r{i}": DiffusionParams(num_inference_steps=3, seed=i, num_images=1 + (i == 2))
              for i in range(6)}
    for rid, p in params.items():
        engine.add_request(rid, "a 5", p)
    done = run(engine)
    assert max(pipe.rows) == 3 and sum(pipe.rows) == 3 * 7      # full steps, never more
    for rid, p in params.items():
        assert done[rid].error is None
        assert torch.equal(done[rid].images, alone(digits, rid, p)), rid


def test_unmeasured_sizes_run_alone_first(digits: DigitsPipeline) -> None:
    """No start-up profile (a split stage's): the first step runs one request, measured;
    then the steps fill up to the room."""
    engine, pipe, _ = budgeted(digits, room_rows=3.5, profile=False)
    for i in range(4):
        engine.add_request(f"r{i}", "a 5", DiffusionParams(num_inference_steps=2, seed=i))
    run(engine)
    assert pipe.rows[:2] == [1, 3]


def test_a_request_too_large_alone_is_refused_naming_its_size(digits: DigitsPipeline) -> None:
    engine, _, _ = budgeted(digits, room_rows=3.5)
    engine.add_request("ok", "a 5", DiffusionParams(num_inference_steps=2))
    with pytest.raises(InputError, match=r"4 image\(s\) .* 4\.4 MiB .* 3.5 MiB left "
                                         r".*memory_fraction"):
        engine.add_request("big", "a 5", DiffusionParams(num_images=4))
    assert set(engine.requests) == {"ok"} and run(engine)["ok"].error is None


def test_out_of_memory_fails_the_request_that_alone_does_not_fit(
        digits: DigitsPipeline) -> None:
    """A request that takes ten times its prediction runs its step out of memory: the step
    is run again per request, cached memory given back first; it fails alone with a clear
    error, the others of its step and those after it complete."""
    engine, pipe, device = budgeted(digits, room_rows=3.5, hogs={"hog"})
    for rid in ("a", "hog", "b"):
        engine.add_request(rid, "a 5", DiffusionParams(num_inference_steps=2, seed=1))
    done = run(engine)
    assert done["hog"].error.message.startswith("out of memory: this request alone (1 image(s)")
    assert "memory_fraction" in done["hog"].error.message and device.num_frees >= 1
    engine.add_request("c", "a 5", DiffusionParams(num_inference_steps=2, seed=1))
    done |= run(engine)
    assert [done[rid].error for rid in "abc"] == [None] * 3
    assert torch.equal(done["c"].images, done["a"].images)      # same seed, same image


def test_an_out_of_memory_step_fails_its_requests_only(digits: DigitsPipeline) -> None:
    """Memory runs out for the step and each retry (another process took it): the step's
    three requests fail; the request waiting behind them runs later and completes."""
    engine, pipe, device = budgeted(digits, room_rows=3.5)
    for i in range(4):
        engine.add_request(f"r{i}", "a 5", DiffusionParams(num_inference_steps=2, seed=i))
    device.fail_next = 4                                # the step, then each request alone
    done = run(engine)
    for rid in ("r0", "r1", "r2"):
        assert done[rid].error.message.startswith("out of memory: this request alone"), done[rid].error
    assert done["r3"].error is None and device.num_frees == 4
    assert not engine.has_unfinished_requests


def test_an_out_of_memory_decode_fails_its_request_only(digits: DigitsPipeline,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    engine, pipe, device = budgeted(digits, room_rows=3.5)
    decode = digits.decode

    def failing(latents: torch.Tensor, params: DiffusionParams) -> torch.Tensor:
        if params.seed == 13:
            raise torch.OutOfMemoryError("Tried to allocate 9 GiB")
        return decode(latents, params)

    monkeypatch.setattr(digits, "decode", failing)
    for i, seed in enumerate((13, 14)):
        engine.add_request(f"r{i}", "a 5", DiffusionParams(num_inference_steps=2, seed=seed))
    done = run(engine)
    assert done["r0"].error.message == "OutOfMemoryError: Tried to allocate 9 GiB"
    assert done["r1"].error is None and device.num_frees == 1


@pytest.mark.parametrize("shape, power, noise", [("line", 1, 0), ("noisy line", 1, 0.01),
                                                 ("parabola", 2, 0)])
def test_the_fit_follows_the_measured_peaks(shape: str, power: int, noise: float) -> None:
    """Three measured sizes: a line when the peaks grow linearly (memory-efficient
    attention; a middle point 1% low is noise, not a parabola), a parabola when they grow
    with the square; unseen sizes are predicted."""
    fit = ActivationFit()
    peak = lambda size: 4096 + 8 * size ** power                      # noqa: E731
    for size in (1024, 2048, 4096):
        fit.record(size, int(peak(size) * (1 - noise * (size == 2048))))
    for size in (1536, 8192):
        assert fit.predict(size) == pytest.approx(peak(size), rel=0.02), (shape, size)


def test_one_measured_size_predicts_no_less_than_it() -> None:
    fit = ActivationFit()
    assert fit.predict(100) is None
    fit.record(1000, 5000)
    assert fit.predict(500) == 5000 and fit.predict(2000) == 10000


def test_true_cfg_rows_count_twice_unless_cfg_parallel_splits_them() -> None:
    """A request with true CFG runs its negative branch in the same transformer call: twice
    its images' rows in a step, in the prediction, the admission and what a measured peak
    teaches; on a CFG-parallel rank only its own branch."""
    from types import SimpleNamespace

    def request(images: int, cfg: bool) -> SimpleNamespace:
        cond = {"prompt_embeds": torch.zeros(1)}
        if cfg:
            cond["negative_prompt_embeds"] = torch.zeros(1)
        return SimpleNamespace(latents=torch.zeros(images, 4, 8), cond=cond)

    device = ByteDevice(HELD + 100 * ROW)
    budget = MemoryBudget(device, HELD + 100 * ROW)
    budget.start()
    device.allocate(6 * ROW)                  # a step of 2 images with CFG, 1 without: 5 rows
    budget.record([request(2, True), request(1, False)])
    per_row = budget.fit.predict(32)
    assert per_row == -(-6 * ROW // 5)
    assert budget.cost(request(3, True)) == 2 * budget.cost(request(3, False))
    admitted = budget.admit([request(20, True), request(20, True), request(20, False)])
    # 40 rows of the first, then the second's 40 would pass the room: the plain one's 20 join
    assert [r.latents.shape[0] * len(r.cond) for r in admitted] == [40, 20]
    split = MemoryBudget(device, HELD + 100 * ROW, cfg_split=True)
    split.fit = budget.fit
    assert split.cost(request(3, True)) == budget.cost(request(3, False))
