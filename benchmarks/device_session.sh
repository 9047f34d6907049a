#!/usr/bin/env bash
# One call on the lent GPU machine (device tool): the GPU tests, then the AR benchmarks with
# and without the experimental fused matmul-vector kernels, results under $OUT. The machine's
# image has torch, triton and transformers; the rest travels as wheels in .whl/ (git-ignored:
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl msgspec pyzmq diffusers
# soundfile cffi pycparser importlib_metadata zipp gguf silero-vad`), named in the call's `carry`
# (gguf: GGUF files and `dgguf`; silero-vad: realtime's server_vad turns):
#
#     run(command="bash benchmarks/device_session.sh", carry=[".whl"], timeout_s=600)
#
# .whl/ and the tree together must stay under carry's 64 MiB: set aside what a call does not
# need (cosyvoice3's onnx, onnxruntime, flatbuffers, protobuf, ml_dtypes; diffusers; silero_vad).
#
# Stages (STAGES="tests single" picks some; the default: "tests single latency"):
#   tests    the GPU tests (about 4 min)
#   single   single stream: all on, no PDL, no PDL or gemv, eager
#   latency  bench ar: concurrency 1 / 8 / 64 against transformers
#   confirm  the GPU tests, single stream twice and bench ar, with this GPU's defaults
#   pdl      the GPU tests, single stream against the kernels before early launch, the
#            layers' critical path (PDL_FLAGS: other kernels/layer_kernel.py flags)
#   tune     in-step sweeps (TUNE_FLAGS), single stream against TUNE_SINGLE's flags
#   batch    8 and 64 requests with and without early launch; h200: the H200's variants
#   layer, dattn, async, profile: earlier sessions' comparisons; omni: bench omni (minutes)
#   tts      bench tts against qwen-tts, whose wheels travel in .whl/ref/ (the list and the
#            download command: omnistage/benchmarks/tts.py), installed into /tmp/ref-site
#   video    bench video: Wan2.2-TI2V-5B and Wan2.1-14B shapes against diffusers eager and
#            compiled, per step with CFG, and step caching (VIDEO_FLAGS: more options; about
#            6 minutes on an H100, alone: STAGES=video)
#   realtime bench realtime (spoken turns over /v1/realtime at 1 and 8 sessions, then
#            turn-taking per turn_detection mode: about 40 s more); the server needs fastapi,
#            starlette, pydantic, pydantic_core, annotated_types, typing_inspection, uvicorn,
#            websockets, python_multipart and opentelemetry_api among the wheels, server_vad
#            the silero_vad wheel in .whl/
#   duplex   bench duplex: random-weight Moshi-7B shape on the full-duplex runtime, 1 / 4 / 8 /
#            16 / 24 / 32 sessions for 200 ticks each (issue 45: duplex_sessions_per_gpu,
#            duplex_tick_p99_ms); a 15.5 GB checkpoint is built and saved first (estimated 5
#            minutes in all: alone, STAGES=duplex; DUPLEX_FLAGS: more options; the JSON is
#            rewritten after each N, so a run cut short keeps the Ns it finished); the tiny
#            Moshi on CUDA runs first (duplex_moshi-tiny_cuda.json)
#   models   the GPU tests of the model families of issue 24 (SD3, Qwen-Image-Edit, FLUX.2,
#            Qwen2.5-Omni) and their benchmarks against the reference
#   regress  bench regress: the headline figures (REGRESS_PROBES, default ar,omni,omni25)
#            against benchmarks/results/baselines/<gpu>.json; the verdicts and the result
#            under $OUT (REGRESS_FLAGS=--update-baseline to refresh the baseline on purpose)
#   families the new families' step benchmarks at their real shapes against diffusers eager
#            and compiled: LTX-2 (omnistage.benchmarks.ltx2) and HunyuanVideo-1.5
#            (omnistage.benchmarks.hunyuan_video15), one model on the GPU at a time, and
#            VibeVoice (omnistage.benchmarks.vibevoice, against transformers' generate)
#   growth   bench omni qwen2.5-omni with token2wav chunk_blocks 4 (default) and 8 (growing
#            2, 4, 8), concurrency 1 / 8 / 32
#   prefill  prompt steps from CUDA graphs against eager (ar.max_graph_tokens 512 / 0): the AR
#            GPU tests, Qwen3-Omni and Qwen3-TTS first audio at c1 / c8 (needs .whl/ref)
#   fp8gemv  the one-row kernels' tests with FP8 weights, AR single stream bf16 against fp8
#   rows     several rows through the fused matmul kernels (their tensor-core variant, issue
#            41): the kernel tests, the tile sweep at 2..16 rows against cuBLAS (Qwen3-0.6B's
#            and 1.7B's matmuls), AR decode at 8 sequences with one-row kernels only against
#            up to 16 rows
#   agent    the voice agent (LLM -> Qwen3-TTS, issue 45): first audio from the request at 1 and
#            8 requests, omnistage bench agent (AGENT_FLAGS: e.g. --llm qwen3-1.7b; needs
#            .whl/ref: qwen-tts builds the talker)
#   int4gemv the W4A16 decode kernel's tests on the GPU, then AR single stream bf16 against int4
#            (the preset written again as W4A16 by models/int4_export.py, groups of 128)
#   contend  Qwen3-Omni first audio at 1 and 8 requests with the thinker writing 64 tokens (the
#            bench's) against 8 (done before the first chunk): how much of the talker's frame
#            time at 8 is the thinker's steps sharing the GPU (issue 41)
#   speech   bench speech: CosyVoice3, Voxtral-TTS and MiMo-Audio at their released shapes
#            (random weights), the served graphs at 1 / 8 / 32, no reference run (issue 43);
#            cosyvoice3 needs onnx, onnxruntime, flatbuffers, protobuf, ml_dtypes in .whl/
#            (SPEECH_FAMILIES picks some: e.g. "voxtral-tts:130 mimo-audio:160")
#   quant    AR single stream bf16 / fp8 / int8 (ar_offline --quantization); with "quantdit"
#            also bench diffusion --quantization int8 (Qwen-Image shape, minutes)
#   arq8     AR stages quantized at load against bf16 in one process (omnistage.benchmarks.
#            ar_quant: decode speed-up, teacher-forced and greedy token agreement, weight
#            bytes), fp8 and int8, for each of QUANT_PRESETS (default "qwen3-0.6b qwen3-1.7b");
#            ar_quant_<preset>.json (not "*quant*": that pattern is the quant stage's)
#   dgguf    bench diffusion --quantization gguf: Qwen-Image's transformer as GGUF Q8_0 and
#            Q4_0 blocks against our bf16 (image PSNR, memory, speed; about 2 minutes)
#   sdpafirst cuDNN's attention on a new sequence length against its later calls and flash's
#            (omnistage.benchmarks.kernels.sdpa_first_call, Qwen-Image's 1024 px shape)
#   tp30b    two GPUs: Qwen3-Omni-30B-A3B's real size, thinker TP 2, against transformers
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
STAGES=${STAGES:-"tests single latency"}
if [[ $STAGES == *tests* ]]; then
    python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" -q \
        tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
fi
if [[ $STAGES == *layer* ]]; then
    # the one-kernel-a-layer path: its tests, then single stream with it (tile configs from
    # LAYER_CONFIGS, "MAX_TILE,WARPS" each) and without it (the per-op kernels), same machine
    timeout 300 python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" \
        -q -x tests/golden/layers/test_triton_decoder_layer.py tests/gpu/test_ar_cuda.py -k layer_kernel \
        2>&1 | tee "$OUT/layer_tests.txt" | tail -15
    for cfg in "--no-layer-kernel" "--layer-kernel" ${LAYER_CONFIGS:-}; do
        flags=$cfg
        [[ $cfg == *,* ]] && flags="--layer-kernel --layer-kernel-config $cfg"
        name=layer$(echo "$cfg" | tr ' ,-' '___')
        timeout 240 python3 -m omnistage.benchmarks.ar_offline --single-stream --output-len 256 --skip-hf \
            $flags --out "$OUT/$name.json" 2>&1 | grep -E "decode_tokens_per_s|share|Error|error" \
            | head -5
    done
fi
if [[ $STAGES == *dattn* ]]; then
    # one attention kernel for small decode batches: its tests and the GPU tests around it,
    # the layers' device time, single stream with and without it (and the layer kernel)
    timeout 300 python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" \
        -q -x tests/layers tests/gpu/test_ar_cuda.py 2>&1 | tee "$OUT/dattn_tests.txt" | tail -5
    timeout 100 python3 -m omnistage.benchmarks.kernels.decode_attention --out "$OUT/decode_attention.json" \
        2>&1 | grep variant
    timeout 150 python3 -m omnistage.benchmarks.kernels.layer_kernel --out "$OUT/layers.json" 2>&1 \
        | grep variant
    for flags in "--no-layer-kernel" "--no-layer-kernel --decode-attention" "--layer-kernel"; do
        name=single$(echo "$flags" | tr ' -' '__')
        timeout 150 python3 -m omnistage.benchmarks.ar_offline --single-stream --output-len 256 --skip-hf \
            $flags --out "$OUT/$name.json" 2>&1 | grep -E "decode_tokens_per_s|Error" | head -3
    done
fi
if [[ $STAGES == *async* ]]; then
    # async scheduling: the GPU tests around it, single stream (per-op kernels and the layer
    # kernel) and 64 requests at once, each with and without
    timeout 200 python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" \
        -q -x tests/gpu/test_ar_cuda.py tests/gpu/test_cuda.py 2>&1 | tee "$OUT/async_tests.txt" \
        | tail -3
    for lk in --no-layer-kernel --layer-kernel --no-layer-kernel; do
        for a in --no-async-scheduling ""; do
            name=single${lk//-/_}${a//-/_}_$SECONDS
            timeout 120 python3 -m omnistage.benchmarks.ar_offline --single-stream --output-len 256 \
                --skip-hf $lk $a --out "$OUT/$name.json" 2>&1 | grep -E "decode_tokens_per_s|Error"
        done
    done
    for a in "" --no-async-scheduling; do
        timeout 150 python3 -m omnistage.benchmarks.ar_offline --num-prompts 64 --skip-hf $a \
            --out "$OUT/c64${a//-/_}.json" 2>&1 | grep -E "tokens_per_s|Error" | head -3
    done
fi
if [[ $STAGES == *pdl* ]]; then
    # programmatic dependent launch with each kernel's dependent launched at its start (with
    # the one-kernel attention and the tiles swept that way, the H100's defaults): the GPU
    # tests, single stream against the kernels before (alternated), the layers' critical path
    timeout 420 python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" \
        -q tests/gpu tests/layers 2>&1 | tee "$OUT/pdl_tests.txt" | tail -4
    before="--pdl-early off --decode-attention off --gemv-config 4,1024,4,3"
    for i in 1 2; do
        for flags in "" "$before"; do
            name=single_$([[ -z $flags ]] && echo defaults || echo before)_$i
            timeout 120 python3 -m omnistage.benchmarks.ar_offline --single-stream --output-len 256 \
                --skip-hf --no-layer-kernel $flags --out "$OUT/$name.json" 2>&1 \
                | grep -E "decode_tokens_per_s|Error"
        done
    done
    timeout 200 python3 -m omnistage.benchmarks.kernels.layer_kernel ${PDL_FLAGS:---timeline} \
        --out "$OUT/layers_pdl_early.json" 2>&1 | tee "$OUT/layers_pdl_early.log" \
        | grep -E 'span|Error'
fi
if [[ $STAGES == *tune* ]]; then
    # the one-row step's settings inside the whole step: the one-kernel attention's, then the
    # matmul tiles (coordinate sweep), each against the defaults of the same process
    timeout 540 python3 -m omnistage.benchmarks.kernels.layer_kernel \
        ${TUNE_FLAGS:---attention-variants --sweep-gemv} \
        --out "$OUT/layers_tune.json" 2>&1 | tee "$OUT/layers_tune.log" | grep -E 'span|Error|best'
    for i in 1 2; do   # single stream: the defaults against TUNE_SINGLE's flags
        for flags in "" ${TUNE_SINGLE:+"$TUNE_SINGLE"}; do
            name=single_$([[ -z $flags ]] && echo defaults || echo variant)_$i
            timeout 120 python3 -m omnistage.benchmarks.ar_offline --single-stream --output-len 256 \
                --skip-hf $flags --out "$OUT/$name.json" 2>&1 | grep -E "decode_tokens_per_s|Error"
        done
    done
fi
if [[ $STAGES == *single* ]]; then
    for flags in "" "--no-pdl" "--no-gemv --no-pdl" "--enforce-eager"; do
        name=single$(echo "$flags" | tr ' -' '__')
        python3 -m omnistage.benchmarks.ar_offline --single-stream --output-len 256 --skip-hf $flags \
            --out "$OUT/$name.json" 2>&1 | grep decode_tokens_per_s
    done
fi
if [[ $STAGES == *profile* ]]; then
    python3 -m omnistage.benchmarks.kernels.profile_decode --batch 1 --out "$OUT/profile_bs1.json" 2>&1 \
        | grep -v Warn | head -24
fi
if [[ $STAGES == *latency* ]]; then
    python3 -m omnistage.entrypoints.cli.main bench ar --out-dir "$OUT" --name ar_latency 2>&1 \
        | tail -12
fi
if [[ $STAGES == *h200* ]]; then
    # on an H200: its defaults (the layer kernel) against the per-op kernels with the H100's
    # settings (early launch, one-kernel attention, with the H100's tiles and with its own)
    per_op="--no-layer-kernel --pdl-early on --decode-attention on"
    for i in 1 2; do
        for flags in "" "$per_op --gemv-tiles-of H100" "$per_op"; do
            name=single_h200_$(echo "x$flags" | tr -d ' -' | cut -c1-40)_$i
            timeout 120 python3 -m omnistage.benchmarks.ar_offline --single-stream --output-len 256 \
                --skip-hf $flags --out "$OUT/$name.json" 2>&1 \
                | grep -E "decode_tokens_per_s|Error" | sed "s/^/[$flags] /"
        done
    done
fi
if [[ $STAGES == *confirm* ]]; then
    # the defaults on this GPU: the GPU tests, single stream twice, bench ar (c = 1, 8, 64)
    timeout 330 python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" \
        -q tests/gpu tests/layers 2>&1 | tee "$OUT/confirm_tests.txt" | tail -2
    for i in 1 2; do
        timeout 100 python3 -m omnistage.benchmarks.ar_offline --single-stream --output-len 256 --skip-hf \
            --out "$OUT/single_defaults_$i.json" 2>&1 | grep -E "decode_tokens_per_s|share|Error"
    done
    timeout 200 python3 -m omnistage.entrypoints.cli.main bench ar --out-dir "$OUT" \
        --name ar_latency 2>&1 | grep -A5 ratios
fi
if [[ $STAGES == *batch* ]]; then
    # 8 and 64 requests at once (256 + 128 tokens) with PDL's early launch (the H100's
    # default) and without, alternated
    for n in ${BATCH_SIZES:-8 64}; do
        for early in on off on off on off; do
            timeout 150 python3 -m omnistage.benchmarks.ar_offline --num-prompts $n --skip-hf \
                --pdl-early $early --out "$OUT/c${n}_pdl_early_${early}_$SECONDS.json" 2>&1 \
                | grep -E "output_tokens_per_s|Error" | head -1 | sed "s/^/c$n early $early /"
        done
    done
fi
if [[ $STAGES == *omni* ]]; then
    python3 -m omnistage.entrypoints.cli.main bench omni --out-dir "$OUT" --name omni 2>&1 \
        | tail -12
fi
if [[ $STAGES == *tts* ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ref-site .whl/ref/*.whl >/dev/null 2>&1 || exit 1
    OMNISTAGE_TTS_REF_PYTHONPATH=/tmp/ref-site python3 -m omnistage.entrypoints.cli.main \
        bench tts --out-dir "$OUT" --name tts ${TTS_FLAGS:-} 2>&1 | tail -20
fi
if [[ $STAGES == *families* ]]; then
    for bench in ltx2 hunyuan_video15; do
        timeout 290 python3 -m omnistage.benchmarks.$bench --out "$OUT/$bench.json" 2>&1 \
            | grep -E "speedup|peak|Error" | head -8
    done
    timeout 200 python3 -m omnistage.benchmarks.vibevoice --out-dir "$OUT" 2>&1 | tail -8
fi
if [[ $STAGES == *video* ]]; then
    timeout 580 python3 -m omnistage.entrypoints.cli.main bench video --out-dir "$OUT" \
        --name video ${VIDEO_FLAGS:-} 2>&1 | tee "$OUT/video.log" | grep -v " step " | tail -40
fi
if [[ $STAGES == *realtime* ]]; then
    timeout 300 python3 -m omnistage.entrypoints.cli.main bench realtime --device cuda \
        --out-dir "$OUT" 2>&1 | grep -v Warn | tail -30
fi
if [[ $STAGES == *duplex* ]]; then
    # the tiny Moshi first (seconds): Moshi's first run on CUDA fails fast if it fails
    timeout 90 python3 -m omnistage.entrypoints.cli.main bench duplex --tiny --device cuda \
        --out-dir "$OUT" --name duplex_moshi-tiny_cuda 2>&1 | grep -v Warn | tail -12
    timeout 120 python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" \
        -q tests/gpu/test_moshi_duplex_cuda.py 2>&1 | tee "$OUT/duplex_tests.txt" | tail -3
    timeout 120 python3 -m omnistage.benchmarks.profile_duplex --shape mid --device cuda \
        --sessions 1,8,16,32 --ticks 10 --out "$OUT/profile_duplex_mid_cuda.json" 2>&1 \
        | grep -v Warn | tail -5
    timeout 480 python3 -m omnistage.entrypoints.cli.main bench duplex --device cuda \
        --out-dir "$OUT" ${DUPLEX_FLAGS:-} 2>&1 | grep -v Warn | tail -25
fi
if [[ $STAGES == *models* ]]; then
    timeout 240 python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" \
        -q tests/gpu/test_sd3_cuda.py tests/gpu/test_pipelines_cuda.py \
        tests/gpu/test_qwen2_5_omni_cuda.py 2>&1 | tee "$OUT/model_tests.txt" | tail -8
    timeout 200 python3 -m omnistage.entrypoints.cli.main bench diffusion --model flux2-klein \
        --out-dir "$OUT" 2>&1 | tail -12
    timeout 200 python3 -m omnistage.entrypoints.cli.main bench omni --model qwen2.5-omni \
        --out-dir "$OUT" 2>&1 | tail -12
fi
if [[ $STAGES == *fp8gemv* ]]; then
    # FP8 weights read by the one-row matrix-vector kernels (W8A16, issue 44): the kernel
    # tests on the GPU, then single stream bf16 against fp8 (ar.quantization), in one call
    timeout 200 python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" \
        -q tests/golden/layers/test_triton_ops.py tests/gpu/test_fp8_cuda.py 2>&1 \
        | tee "$OUT/fp8gemv_tests.txt" | tail -3
    for q in "" fp8; do
        timeout 150 python3 -m omnistage.benchmarks.ar_offline --single-stream --output-len 256 \
            --skip-hf ${q:+--quantization $q} --out "$OUT/ar_single_${q:-bf16}.json" 2>&1 \
            | grep -E "decode_tokens_per_s|Error" | head -3
    done
fi
if [[ $STAGES == *regress* ]]; then
    if [[ ${REGRESS_PROBES:-} == *tts* || ${REGRESS_PROBES:-} == *agent* ]]; then
        # qwen-tts builds the TTS checkpoint (the tts and agent probes)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/ref-site .whl/ref/*.whl >/dev/null 2>&1 || exit 1
        export OMNISTAGE_TTS_REF_PYTHONPATH=/tmp/ref-site
    fi
    timeout 500 python3 -m omnistage.entrypoints.cli.main bench regress \
        --probes "${REGRESS_PROBES:-ar,omni,omni25}" --out-dir "$OUT" ${REGRESS_FLAGS:-} \
        2>&1 | grep -v Warn | tail -25
    # a refreshed baseline (REGRESS_FLAGS=--update-baseline) comes back to be committed
    [[ ${REGRESS_FLAGS:-} == *update* ]] && cp benchmarks/results/baselines/*.json "$OUT/"
fi
if [[ $STAGES == *prefill* ]]; then
    # steps with prompt rows from CUDA graphs (ar.max_graph_tokens, default 512) against eager
    # prompts (0), issue 41: the AR GPU tests, then Qwen3-Omni's (bench shape) and Qwen3-TTS
    # 1.7B's first audio at concurrency 1 and 8, eager first, in one call
    timeout 200 python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" \
        -q tests/gpu/test_ar_cuda.py tests/gpu/test_moe_cuda.py 2>&1 \
        | tee "$OUT/prefill_tests.txt" | tail -4
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ref-site .whl/ref/*.whl >/dev/null 2>&1 || exit 1
    for g in 0 512; do
        timeout 150 python3 -m omnistage.entrypoints.cli.main bench omni --concurrency 1,8 \
            --reference-requests 0 --stage-override thinker.ar.max_graph_tokens=$g \
            --stage-override talker.ar.max_graph_tokens=$g --out-dir "$OUT" \
            --name omni_graph_tokens$g 2>&1 | grep -E '"first_audio|Error' | head -4
        OMNISTAGE_TTS_REF_PYTHONPATH=/tmp/ref-site timeout 120 python3 -m \
            omnistage.entrypoints.cli.main bench tts --concurrency 1,8 --reference-requests 0 \
            --stage-override talker.ar.max_graph_tokens=$g --out-dir "$OUT" \
            --name tts_graph_tokens$g 2>&1 | grep -E '"first_audio|Error' | head -4
    done
fi
if [[ $STAGES == *growth* ]]; then
    # Qwen2.5-Omni's token2wav: the default chunks (2, 4, 4, ...) against growing ones (2, 4,
    # 8, 8, ...), concurrency 1 / 8 / 32, in one call (issue 41)
    for cb in 4 8; do
        timeout 240 python3 -m omnistage.entrypoints.cli.main bench omni --model qwen2.5-omni \
            --concurrency 1,8,32 --reference-requests 0 \
            --stage-override token2wav.generation.options.chunk_blocks=$cb --out-dir "$OUT" --name omni25_cb$cb 2>&1 | grep -E "rtf|first_audio" | head -6
    done
fi
if [[ $STAGES == *rows* ]]; then
    timeout 150 python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" \
        -q tests/golden/layers/test_triton_ops.py 2>&1 | tee "$OUT/rows_tests.txt" | tail -3
    for preset in qwen3-0.6b qwen3-1.7b; do
        timeout 150 python3 -m omnistage.benchmarks.kernels.sweep_gemv --preset $preset \
            --rows 2 8 16 --block-n 16 32 --block-k 128 256 --num-warps 4 \
            --num-stages 1 3 --out "$OUT/sweep_rows_$preset.json" 2>&1 | grep "rows"
    done
    for r in 1 16; do
        timeout 120 python3 -m omnistage.benchmarks.ar_offline --num-prompts 8 --output-len 256 \
            --skip-hf --gemv-rows $r --out "$OUT/ar_c8_rows$r.json" 2>&1 \
            | grep -E "output_tokens_per_s|Error" | head -3
    done
fi
if [[ $STAGES == *agent* ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ref-site .whl/ref/*.whl >/dev/null 2>&1 || exit 1
    OMNISTAGE_TTS_REF_PYTHONPATH=/tmp/ref-site timeout 300 python3 -m \
        omnistage.entrypoints.cli.main bench agent --out-dir "$OUT" ${AGENT_FLAGS:-} 2>&1 \
        | grep -v Warn | tail -14
fi
if [[ $STAGES == *int4gemv* ]]; then
    timeout 300 python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" \
        -q tests/golden/layers/test_triton_int4.py tests/golden/models/test_int4_checkpoint.py \
        2>&1 | tee "$OUT/int4gemv_tests.txt" | tail -3
    for preset in ${INT4_PRESETS:-qwen3-0.6b qwen3-1.7b}; do
        for q in "" int4; do
            timeout 300 python3 -m omnistage.benchmarks.ar_offline --preset $preset \
                --single-stream --output-len 256 --skip-hf ${q:+--quantization $q} \
                --out "$OUT/ar_single_${preset}_${q:-bf16}.json" 2>&1 \
                | grep -E "decode_tokens_per_s|Error" | head -3
        done
    done
fi
if [[ $STAGES == *contend* ]]; then
    for t in 64 8; do
        timeout 160 python3 -m omnistage.entrypoints.cli.main bench omni --concurrency 1,8 \
            --reference-requests 0 --thinker-tokens $t --out-dir "$OUT" --name omni_thinker$t \
            2>&1 | grep -E '"first_audio|Error' | head -4
    done
fi
if [[ $STAGES == *speech* ]]; then
    for spec in ${SPEECH_FAMILIES:-cosyvoice3:110 voxtral-tts:130 mimo-audio:160}; do
        timeout ${spec#*:} python3 -m omnistage.entrypoints.cli.main bench speech \
            --family ${spec%%:*} --device cuda --out-dir "$OUT" ${SPEECH_FLAGS:-} 2>&1 \
            | grep -v Warn | tail -14
    done
fi
if [[ $STAGES == *quant* ]]; then
    # issue 44's 8-bit paths: AR single stream bf16 / fp8 / int8, the diffusion transformer's
    # int8 against diffusers eager and compiled (Qwen-Image shape)
    for q in "" fp8 int8; do
        timeout 150 python3 -m omnistage.benchmarks.ar_offline --single-stream --output-len 256 \
            --skip-hf ${q:+--quantization $q} --out "$OUT/ar_single_${q:-bf16}.json" 2>&1 \
            | grep -E "decode_tokens_per_s|Error" | head -3
    done
    [[ $STAGES == *quantdit* ]] && timeout 400 python3 -m omnistage.entrypoints.cli.main \
        bench diffusion --quantization int8 \
        --out-dir "$OUT" --name diffusion_int8 2>&1 | grep -E "int8_|Error" | head -8
fi
if [[ $STAGES == *arq8* ]]; then
    # issue 44: each method's engine against bf16's in one process (ar_quant.py), per preset
    for preset in ${QUANT_PRESETS:-qwen3-0.6b qwen3-1.7b}; do
        timeout 200 python3 -m omnistage.benchmarks.ar_quant --preset $preset \
            --methods fp8,int8 --output-len 256 --out "$OUT/ar_quant_$preset.json" 2>&1 \
            | grep -E '"ar_|Error' | sed "s/^/[$preset] /"
    done
fi
if [[ $STAGES == *dgguf* ]]; then
    # issue 44: GGUF Q8_0 / Q4_0 linears against our bf16 (diffusion_gguf.py), about 120 s
    timeout 300 python3 -m omnistage.entrypoints.cli.main bench diffusion --quantization gguf \
        --cache-thresholds 0.2 --concurrency 2 --out-dir "$OUT" 2>&1 \
        | grep -E "gguf_|Error" | head -20
fi
if [[ $STAGES == *sdpafirst* ]]; then
    timeout 120 python3 -m omnistage.benchmarks.kernels.sdpa_first_call \
        --out "$OUT/sdpa_first_call.json" 2>&1 | grep -v Warn | tail -60   # ~50 lines of JSON
fi
if [[ $STAGES == *tp30b* ]]; then
    # two GPUs (kind nvidia-h100-x2): Qwen3-Omni-30B-A3B at its real size, the thinker on
    # TP 2 against transformers' device_map="auto" on the same GPUs (accelerate and psutil
    # travel in .whl/); about 8 minutes
    timeout 580 python3 -m omnistage.entrypoints.cli.main bench omni --real-size -tp 2 \
        --reference-requests 1 --thinker-tokens 32 --talker-tokens 50 --concurrency 1,8 \
        --out-dir "$OUT" --name omni_qwen3-omni-real_tp2 2>&1 | tail -20
fi
if [[ $STAGES == *t2wq* ]]; then
    # Qwen2.5-Omni's token2wav with its DiT's block linears quantized (issue 41, option
    # token2wav.generation.options.dit_quantization): the quantized DiT's GPU tests (tiny
    # checkpoint: graphed + compiled against eager, SNR against float32), then bench omni
    # qwen2.5-omni at concurrency 1 / 8 / 32 per mode (T2WQ_MODES, default none fp8 int8),
    # each with its waveform SNR against the float32 unquantized DiT; the headline of every
    # mode in $OUT/t2wq_headline.jsonl (at most 9 minutes: alone, STAGES=t2wq)
    timeout 90 python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" \
        -q -s tests/gpu/test_token2wav_quant_cuda.py 2>&1 | tee "$OUT/t2wq_tests.txt" \
        | grep -E " dB|passed|failed|Error" | tail -6
    for q in ${T2WQ_MODES-none fp8 int8}; do
        timeout 150 python3 -m omnistage.entrypoints.cli.main bench omni --model qwen2.5-omni \
            --concurrency 1,8,32 --reference-requests 0 \
            --stage-override token2wav.generation.options.dit_quantization=$q \
            --out-dir "$OUT" --name omni25_ditq_$q > "$OUT/t2wq_$q.log" 2>&1
        python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(json.dumps(
            {'dit_quantization': sys.argv[2], **d['headline']}))" "$OUT/omni25_ditq_$q.json" \
            $q 2>/dev/null | tee -a "$OUT/t2wq_headline.jsonl" \
            || { echo "t2wq $q: no result"; tail -5 "$OUT/t2wq_$q.log"; }
    done
    # T2WQ_PROFILE=1 (a call of its own, about 6 minutes: STAGES=t2wq T2WQ_MODES= T2WQ_PROFILE=1):
    # the DiT's RK4 step alone per mode at 8 and 21 windows, eager, graph and compiled graph
    # (profile_token2wav), q / k / v fused as the stage runs them
    for q in ${T2WQ_PROFILE:+none fp8 int8}; do
        timeout 150 python3 -m omnistage.benchmarks.profile_token2wav --rows 8,21 --iters 10 \
            --no-vocoder --dit-quantization $q --out "$OUT/profile_t2w_$q.json" 2>&1 \
            | grep -E "^dit .*graph|Error" | head -6
    done
fi
