#!/usr/bin/env bash
# Issue 26 on a machine of 4 GPUs (device tool, kind nvidia-h100-x4): each stage one call of
# under 10 minutes, results under $OUT. The wheels (those of device_session.sh, plus Ray's for
# the omni stage: .whl-ray's wheels and its slimmed ray-slim.tar.xz unpacked into the path)
# travel in .whl4/ (git-ignored), named in the call's `carry`:
#
#     run(command="STAGES=wan bash benchmarks/device_x4.sh", carry=[".whl4"],
#         kind="nvidia-h100-x4", timeout_s=600)
#
#   wan     Wan2.2-T2V-A14B 720p x 81 frames: 1 GPU, Ulysses 4, Ulysses 2 x CFG 2, Ulysses 2,
#           CFG 2 against diffusers on 1 GPU (bench video --parallel), each rank's kernel
#           table in wan_profiles.tgz (the communication per step)
#   image   Qwen-Image 1024x1024, true CFG: 1 GPU, CFG 2, CFG 2 x Ulysses 2, TP 4, Ulysses 4
#           against diffusers (bench diffusion --parallel)
#   omni    Qwen3-Omni-30B-A3B's real shape: thinker TP 2 (2 GPUs), TP 4, TP 2 with the
#           talker and code2wav on GPUs of their own, and under Ray one replica of TP 4
#           against two replicas of TP 2, at concurrency 1 and 32 (bench omni --layouts)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl4/*.whl >/dev/null 2>&1 || exit 1
STAGES=${STAGES:-wan}
[[ $STAGES == *omni* ]] && tar xJf .whl4/ray-slim.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
bench() {
    timeout "${LIMIT:-560}" python3 -m omnistage.entrypoints.cli.main bench "$@" \
        --out-dir "$OUT" 2>&1 | grep -vE "^\[transformers\]|Warning|warn\(" | tail -60
}
if [[ $STAGES == *wan* ]]; then
    mkdir -p /tmp/prof
    OMNISTAGE_BENCH_PROFILE=/tmp/prof bench video --parallel ${WAN_LAYOUTS:-ulysses4,cfg2xulysses2,ulysses,cfg}
    tar czf "$OUT/wan_profiles.tgz" -C /tmp/prof .
fi
if [[ $STAGES == *image* ]]; then
    bench diffusion --parallel ${IMAGE_LAYOUTS:-cfg,cfg2xulysses2,tp4,ulysses4}
fi
if [[ $STAGES == *omni* ]]; then
    bench omni --real-size --concurrency 1,32 \
        --layouts ${OMNI_LAYOUTS:-tp2,tp4,tp2-split,ray-2xtp2,ray-tp4}
fi
ls -la "$OUT"
