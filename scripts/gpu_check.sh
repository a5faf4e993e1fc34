#!/usr/bin/env bash
# GPU check (about 5 minutes on one H200): install stagewise against the machine's CUDA torch,
# run the GPU-marked tests and the prefill-graph benchmark on both CUDA backends, print a summary.
# Results land in benchmarks/results/prefill_graph-*-cuda.md; copy the numbers into RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python - <<'PY' || { echo "no CUDA device visible: nothing to check"; exit 1; }
import torch; assert torch.cuda.is_available(); print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY
# Keep the machine's CUDA torch (>= 2.13): install the rest without touching it.
python -m pip install --quiet --no-deps -e . && \
python -m pip install --quiet "transformers==5.23.0" "tokenizers==0.23.3" "safetensors==0.8.0" \
  "fastapi==0.165.0" "uvicorn==0.54.0" "prometheus-client==0.26.0" "tqdm==4.70.1" "pytest==9.0.3" "openai==3.57.0"
status=0
timeout 180 python -m pytest -q -m gpu tests/graph -p no:cacheprovider 2>&1 | tail -20 || status=1
for backend in breakable full; do
  timeout 120 python benchmarks/prefill_graph.py --backend "$backend" --device cuda 2>&1 | tail -25 || status=1
done
echo "== summary =="
ls -1 benchmarks/results/prefill_graph-*-cuda*.md 2>/dev/null
echo "gpu_check exit status: $status"
exit $status
