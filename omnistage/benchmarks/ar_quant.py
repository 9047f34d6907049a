"""Single-stream decode of an AR stage quantized at load (`ar.quantization`: fp8, int8,
int4) against the unquantized model (the reference: bf16 on CUDA), in one process, on one
random-weight checkpoint (issue 44):

    python -m omnistage.benchmarks.ar_quant --preset qwen3-0.6b --methods fp8,int8 \
        --output-len 256 --out benchmarks/results/ar_quant_qwen3-0.6b.json

For the reference and then each method, in turn (each engine freed before the next is built):

    build       AREngine over the same checkpoint (ar_offline.py's single-stream engine: one
                sequence, 4096 batched tokens; its KV cache fixed at KV_TOKENS), the
                method's linears swapped at load
    speed       ar_offline's timing: a warm-up request, then one prompt of `input_len` random
                tokens to `output_len` greedy tokens (eos ignored); decode tokens/s =
                (tokens - 1) / (last token's time - first token's), the median of `repeats`
                runs; the tokens of the first run are the method's greedy stream
    greedy      free running: the share of the reference's greedy tokens that the method's
                stream repeats before the first difference, and that index (None: none)
    forced      teacher forcing: the prompt and the reference's stream (its last token off) as
                one prompt, the hidden state after the final norm kept at every position
                (`output_hidden_layers`), the head applied to the last `output_len` rows: the
                share of the reference's tokens the model ranks first there
    weights     bytes of the distinct parameters and the quantized linears' buffers (weights,
                scales, biases): what one decode step reads where the embedding is tied to
                the head (both presets; an untied table is counted whole, read a row a token)

Headline (`headline`): ar_{method}_decode_speedup (method's decode tokens/s over the
reference's), ar_{method}_token_agreement (teacher-forced), ar_{method}_greedy_prefix_agreement,
ar_{method}_weight_bytes_ratio. The reference forced against its own stream is reported too
(`reference.self_agreement`): the prefill's kernels are not the decode step's, so even the
reference need not reach 1.

The teacher-forced share is the figure to read. A random-weight model's logits have small
margins between its top tokens (no training has separated them), so a quantization error that
a trained model would shrug off flips some argmaxes, and one flip sends a greedy stream down
another path for good: the greedy prefix of a random checkpoint understates agreement.

On the CPU (tests) the reference runs in float32 and `fp8` is applied by the loader with
torch's CPU `_scaled_mm` (an AR stage refuses FP8 off an FP8-capable GPU); int8 and every
CUDA run go through `ARConfig.quantization`, as a stage's `ar.quantization` does.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from omnistage.benchmarks.common import environment, free_device_memory, now, write_result
from omnistage.utils.device import resolve_device

METHODS = ("fp8", "int8", "int4")
KV_TOKENS = 8192    # each engine's KV cache: a fixed size, so that what one engine might leave
                    # behind cannot starve the next (the budget counts all allocated memory)


def build_engine(path: Path, method: str | None, device: torch.device,
                 dtype: torch.dtype):  # -> AREngine
    """The single-stream AREngine over `path`, its linears quantized by `method` (None: as
    loaded)."""
    from omnistage.ar.engine import AREngine
    from omnistage.benchmarks.ar_offline import stage_quantization
    from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig

    loader = None
    quantization = stage_quantization(method) if method else None
    if method == "fp8" and device.type == "cpu":
        quantization, loader = None, _cpu_fp8_loader
    return AREngine(ARConfig(
        model=str(path), device=str(device), dtype=str(dtype).removeprefix("torch."),
        memory_fraction=0.5, quantization=quantization,
        kv_cache=KVCacheConfig(num_blocks=KV_TOKENS // KVCacheConfig().block_size),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=4096)), loader=loader)


def _cpu_fp8_loader(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
    """load_model, then every eligible linear in FP8 through torch's CPU `_scaled_mm`."""
    from omnistage.ar.quantize import quantize_model
    from omnistage.configs.quantization import ComponentQuantization
    from omnistage.models.loader import load_model

    model, model_config, hf_config = load_model(path, device, dtype)
    quantize_model(model, ComponentQuantization("fp8"), device, allow_cpu=True)
    return model, model_config, hf_config


def generate(engine, prompt: list[int], output_len: int, tag: str
             ) -> tuple[list[int], list[float]]:
    """One greedy request to the end: (its tokens, the host time each arrived)."""
    from omnistage.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    engine.add_request(tag, prompt, params)
    tokens: list[int] = []
    times: list[float] = []
    while engine.has_unfinished_requests:
        for o in engine.step():     # host token ids: the device is done with them
            tokens += o.new_token_ids
            times += [time.perf_counter()] * len(o.new_token_ids)
    assert len(tokens) == output_len, (len(tokens), output_len)
    return tokens, times


def decode_speed(engine, prompt: list[int], output_len: int, repeats: int) -> dict[str, object]:
    """ar_offline's single-stream timing, `repeats` times after one warm-up: decode tokens/s
    of each run (the first token excluded), their median, and the first run's tokens."""
    generate(engine, prompt[:16], 8, "warm")
    rates: list[float] = []
    ttfts: list[float] = []
    streams: list[list[int]] = []
    for r in range(repeats):
        t0 = now(engine.device)
        tokens, times = generate(engine, prompt, output_len, f"run{r}")
        rates.append((len(times) - 1) / (times[-1] - times[0]))
        ttfts.append(times[0] - t0)
        streams.append(tokens)
    return {"decode_tokens_per_s": statistics.median(rates), "runs_tokens_per_s": rates,
            "ttft_s": statistics.median(ttfts),
            "deterministic": all(s == streams[0] for s in streams), "tokens": streams[0]}


def forced_argmax(engine, prompt: list[int], reference: list[int]) -> list[int]:
    """The token `engine`'s model ranks first after the prompt and each prefix of `reference`
    (teacher forcing): one prefill of prompt + reference[:-1] that emits the final-norm
    hidden state of every position, the head applied to the last len(reference) rows."""
    from omnistage.sampling_params import SamplingParams

    layer = engine.model_config.num_hidden_layers            # after the final norm
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False,
                            output_hidden_layers=(layer,))
    ids = prompt + reference[:-1]
    engine.add_request("forced", ids, params)
    rows: list[tuple[int, torch.Tensor]] = []
    while engine.has_unfinished_requests:
        rows += [(o.hidden_start, o.hidden_states[layer]) for o in engine.step()
                 if o.hidden_states]
    rows.sort(key=lambda row: row[0])
    hidden = torch.cat([h.to(engine.device) for _, h in rows])          # (P + N - 1, hidden)
    assert [s for s, _ in rows][0] == 0 and hidden.shape[0] == len(ids), (
        [(s, h.shape[0]) for s, h in rows], len(ids))
    with torch.inference_mode():
        logits = engine.model.compute_logits(hidden[len(prompt) - 1:])  # (N, vocab)
    return logits.argmax(-1).tolist()


def agreement(got: list[int], want: list[int]) -> dict[str, object]:
    """Position by position: the share of `want` that `got` matches, and how far it follows
    `want` before the first difference (share and index; None when it never differs)."""
    assert len(got) == len(want) > 0, (len(got), len(want))
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return {"share": sum(a == b for a, b in zip(got, want)) / len(want),
            "prefix": (len(want) if first is None else first) / len(want),
            "first_divergence": first, "num_tokens": len(want)}


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the distinct parameters and of the quantized linears' buffers, the number of
    quantized linears); a tied embedding counts once, KV caches and rotary tables not at all."""
    from omnistage.layers.fp8 import Fp8Linear
    from omnistage.layers.int4 import Int4Linear
    from omnistage.layers.int8 import Int8Linear

    tensors = {p.data_ptr(): p for p in model.parameters()}
    quantized = [m for m in model.modules() if isinstance(m, (Fp8Linear, Int8Linear, Int4Linear))]
    for m in quantized:
        tensors.update({b.data_ptr(): b for b in m.buffers(recurse=False)})
    return sum(t.numel() * t.element_size() for t in tensors.values()), len(quantized)


def measure(path: Path, method: str | None, prompt: list[int], output_len: int, repeats: int,
            device: torch.device, dtype: torch.dtype,
            reference: list[int] | None = None) -> dict[str, object]:
    """One engine (reference: method None) built, timed, forced against `reference` (None:
    its own stream) and freed."""
    engine = build_engine(path, method, device, dtype)
    speed = decode_speed(engine, prompt, output_len, repeats)
    own = speed.pop("tokens")
    want = own if reference is None else reference
    result: dict[str, object] = {**speed, "method": method or str(dtype).removeprefix("torch.")}
    result["weight_bytes"], result["num_quantized_linears"] = weight_bytes(engine.model)
    forced = agreement(forced_argmax(engine, prompt, want), want)
    result["forced"] = forced
    if reference is not None:
        result["greedy"] = agreement(own, want)
    result["tokens"] = own
    del engine
    free_device_memory(device)
    result["allocated_after_free_gib"] = (torch.cuda.memory_allocated(device) / 2**30
                                          if device.type == "cuda" else None)
    return result


def run(path: Path, methods: tuple[str, ...], prompt: list[int], output_len: int,
        repeats: int = 3, device: str = "auto") -> dict[str, object]:
    """The reference, then each of `methods`, on one checkpoint (module docstring)."""
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"methods: {m!r} is not one of {', '.join(METHODS)}")
    if output_len < 2 or repeats < 1 or len(prompt) + output_len > KV_TOKENS // 2:
        raise ValueError(f"output_len={output_len}, repeats={repeats}, input_len="
                         f"{len(prompt)}: need output_len >= 2 (a decode rate needs two "
                         f"tokens), repeats >= 1, input_len + output_len <= {KV_TOKENS // 2}")
    dev = resolve_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ref = measure(path, None, prompt, output_len, repeats, dev, dtype)
    ref["self_agreement"] = ref["forced"]["share"]
    runs = {m: measure(path, m, prompt, output_len, repeats, dev, dtype, ref["tokens"])
            for m in methods}
    return {"benchmark": "ar_quant_single_stream", **environment(dev),
            "dtype": str(dtype).removeprefix("torch."), "input_len": len(prompt),
            "output_len": output_len, "repeats": repeats, "reference": ref, "methods": runs,
            "headline": headline(ref, runs)}


def headline(ref: dict[str, object], runs: dict[str, dict[str, object]]) -> dict[str, float]:
    """Issue 44's names: per method, decode speed and weight bytes over the reference's, and
    both agreements."""
    out: dict[str, float] = {}
    for m, r in runs.items():
        out[f"ar_{m}_decode_speedup"] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        out[f"ar_{m}_token_agreement"] = r["forced"]["share"]
        out[f"ar_{m}_greedy_prefix_agreement"] = r["greedy"]["prefix"]
        out[f"ar_{m}_weight_bytes_ratio"] = r["weight_bytes"] / ref["weight_bytes"]
    return out


def _parser() -> argparse.ArgumentParser:
    from omnistage.benchmarks.ar_offline import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="a checkpoint folder to use instead of the preset's (tests)")
    ap.add_argument("--methods", default="fp8", help=f"comma-separated: {', '.join(METHODS)}")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--checkpoint-dir", default="/tmp/omnistage-bench",
                    help="where the preset's random-weight checkpoint is built (ar_offline.py's "
                         "folder: the same weights)")
    ap.add_argument("--out", type=Path, default=None, help="the result's JSON file")
    return ap


def main(argv: list[str] | None = None) -> dict[str, object]:
    from omnistage.benchmarks.ar_offline import build_checkpoint

    args = _parser().parse_args(argv)
    path = args.checkpoint or build_checkpoint(args.preset,
                                               Path(args.checkpoint_dir) / args.preset)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)                                  # ar_offline's prompt
    prompt = [rng.randrange(vocab) for _ in range(args.input_len)]
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    result = run(path, methods, prompt, args.output_len, args.repeats, args.device)
    result["preset"] = None if args.checkpoint else args.preset
    result["checkpoint"] = str(path)
    for r in (result["reference"], *result["methods"].values()):
        r.pop("tokens")                                     # agreement says what they show
    print(json.dumps(result["headline"], indent=2))
    if args.out:
        write_result(result, args.out.parent, args.out.name.removesuffix(".json"))
    return result


if __name__ == "__main__":
    main()
