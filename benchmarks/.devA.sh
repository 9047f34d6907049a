python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl1/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
T="python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts= -q"
timeout 200 $T tests/gpu/test_sd3_cuda.py tests/gpu/test_pipelines_cuda.py tests/gpu/test_qwen2_5_omni_cuda.py tests/golden/layers/test_triton_ops.py -k "sd3 or qwen_image or flux or omni or quantize or dit" 2>&1 | tee $OUT/gpu_tests.txt | tail -6
B="python3 -m omnistage.entrypoints.cli.main bench diffusion --out-dir $OUT"
timeout 260 $B --model qwen-image --kernel-profile 2>&1 | grep -v USDT | tail -14
timeout 200 $B --model z-image-turbo --start-times 2>&1 | grep -v USDT | tail -14
