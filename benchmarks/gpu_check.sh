#!/usr/bin/env bash
# The CUDA checks of one device session (issue 12), in under 5 minutes on one GPU; run from the repository
# root on a machine with CUDA, torch, transformers, numba, pytest and hypothesis (nothing is installed or
# downloaded). Prints what to copy into benchmarks/README.md.
set -uo pipefail
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$PWD
python - <<'PY'
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
# 1. the bridge on CUDA against the CPU, and the losses in bf16 on CUDA against float32 on the CPU
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_bridge.py tests/test_losses.py -k "cuda" 2>&1 | tail -5
# 2. the loss benchmark at a realistic size: V = 151936 (Qwen2), H = 896 (Qwen2-0.5B), B = 4, T = 1024, K = 3
timeout 300 python benchmarks/bench_losses.py --device cuda --V 151936 --H 896 --T 1024 --repeats 3 2>&1 | tail -14
