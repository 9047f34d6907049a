#!/usr/bin/env bash
# BAGEL against its upstream code on one GPU (issue 42: bagel_speedup_vs_reference), in one
# call of the device tool; results under $OUT:
#
#     run(command="bash benchmarks/bagel_device.sh", carry=[".whl", "out/bagel"], timeout_s=600)
#
# What travels (both git-ignored):
#   .whl/               our own wheels (benchmarks/device_session.sh says which)
#   out/bagel/whl/      the reference's packages, shadowing the image's for its process alone:
#                       python3 -m pip download --no-deps --only-binary=:all: \
#                         --python-version 3.12 --implementation cp \
#                         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#                         --platform manylinux2014_x86_64 -d out/bagel/whl transformers==4.49.0 \
#                         tokenizers==0.21.4 huggingface_hub==0.36.2
#                       (14 MB; the rest the upstream imports, torch, einops, safetensors,
#                       numpy, pillow, tqdm, is the image's)
#   out/bagel/upstream/ ByteDance-Seed/Bagel at the commit scripts/bagel_fixtures.py pins:
#                       git -C MIRROR archive 056b5fd51a88c1eb4547318609e25d40080fcf87 \
#                         inferencer.py modeling data LICENSE README.md | tar -x -C DIR
#                       and that commit written to DIR/COMMIT (0.6 MB)
#
# BAGEL_LAYERS: the runs, by LLM layers of the 28 (default "4 28": a short run first, then the
# full depth, which builds, saves and loads a 28 GB checkpoint); BAGEL_STEPS (default 10);
# BAGEL_FLAGS: more flags of omnistage.benchmarks.bagel. Each run at most BAGEL_TIMEOUT
# seconds (default: 200 for the first, what is left of 540 for the others). A check of this
# script on a CPU (no GPU there; SITE empty: our wheels are cp312 and the venv has them):
# PYTHON=.venv/bin/python BAGEL_DEVICE=cpu SITE= REF_SITE=/tmp/x-bagel-site BAGEL_LAYERS=2
# BAGEL_STEPS=3 BAGEL_FLAGS="--shape small" bash benchmarks/bagel_device.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
SITE=${SITE-/tmp/site}
REF_SITE=${REF_SITE:-/tmp/bagel-site}
mkdir -p "$OUT"
pip_target() {
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$1" "${@:2}" >/dev/null 2>&1
}
if [[ -n $SITE ]]; then
    pip_target "$SITE" .whl/*.whl || { echo "our wheels did not install"; exit 1; }
fi
pip_target "$REF_SITE" out/bagel/whl/*.whl || { echo "the reference's wheels did not install"; exit 1; }
export PYTHONPATH=${SITE:+$SITE:}$PWD PYTHONUNBUFFERED=1 OMNISTAGE_BAGEL_REF_PYTHONPATH=$REF_SITE
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
probe='import transformers, tokenizers, huggingface_hub as h; print(transformers.__version__, tokenizers.__version__, h.__version__, transformers.__file__)'
echo "ours:      $("$PY" -c "$probe")"
echo "reference: $(PYTHONPATH=$REF_SITE:$PYTHONPATH "$PY" -c "$probe")"
df -h /tmp /dev/shm | tail -2
free -g | head -2
summary='import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"shape": r["shape"], "ratios": r["ratios"], "max_abs_diff": r["max_abs_diff"],
    "peak_memory_gb": {k: v and round(v / 1e9, 2) for k, v in r["peak_memory_bytes"].items()},
    "per_image_s": [r["reference"]["per_image_s"], r["ours"]["per_image_s"]],
    "per_step_s": [r["reference"]["per_step_s"], r["ours"]["per_step_s"]],
    "setup_s": r["reference"]["setup_s"], "versions": r["reference"]["versions"]}))'
first=1
for layers in ${BAGEL_LAYERS:-4 28}; do
    limit=${BAGEL_TIMEOUT:-$(( first ? 200 : 540 - SECONDS ))}
    first=0
    if (( limit < 60 )); then echo "layers $layers: skipped (${limit}s left)"; continue; fi
    # the checkpoint folder (bfloat16 LLM and ViT, about 3 + 0.93 GB a layer at 7b) goes where
    # it fits with 4 GB to spare: /tmp, else /dev/shm
    need=$(( (7 + layers * 93 / 100) * 1048576 ))
    dir=""
    for d in /tmp /dev/shm; do
        if (( $(df -k --output=avail "$d" | tail -1) > need )); then dir=$d; break; fi
    done
    if [[ -z $dir ]]; then echo "layers $layers: skipped (no room for its checkpoint)"; continue; fi
    name=bagel_h200_layers$layers
    echo "== layers $layers (at most ${limit}s, checkpoint under $dir)"
    TMPDIR=$dir timeout "$limit" "$PY" -m omnistage.benchmarks.bagel --layers "$layers" \
        --steps "${BAGEL_STEPS:-10}" --images 2 --device "${BAGEL_DEVICE:-cuda}" \
        --upstream "$PWD/out/bagel/upstream" ${BAGEL_FLAGS:-} --out "$OUT/$name.json" \
        >"$OUT/$name.log" 2>&1
    rc=$?
    grep -E "^reference:" "$OUT/$name.log"
    if [[ $rc == 0 ]]; then
        "$PY" -c "$summary" "$OUT/$name.json"
    else
        echo "layers $layers: exit $rc"; grep -v '^ ' "$OUT/$name.log" | tail -25
    fi
    echo "   ${SECONDS}s so far"
done
