#!/usr/bin/env bash
# One device call that measures what the CPU cannot: GPU tests, the layer benchmark with every split option
# (eager and CUDA-graph), the communication benchmark and a per-kernel profile. Writes everything under $OUT.
#   usage (device tool, kind nvidia-h200-x4 or -x2):  MEGAMOE_COMMIT=<sha> bash benchmarks/gpu_session.sh [quick]
# Sections are ordered by value and each has its own time limit, so a short lease still returns the first ones.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out/gpu_session}
mkdir -p "$OUT"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
quiet() { grep -v "^W1\|OMP_NUM\|^\*\*\*\*" ; }
echo "== GPUs: $NGPU, commit ${MEGAMOE_COMMIT:-unknown}"

echo "== 1. split: sync-free step, graph capture, overlap, reference on every rank count; FP8 GEMM test"
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu_split.py tests/test_grouped_gemm.py \
  -k "sync or graph or overlap or on_gpus or fp8_gpu" 2>&1 \
  | grep -v "^frame\|^E *frame" > "$OUT/gpu_split.log"; grep -E "passed|failed|Error:" "$OUT/gpu_split.log" | tail -5

SPLITS="torch,split,split:presum_combine=1,split:presum_combine=1:overlap_backward=1"
for p in qwen3-30b-a3b deepseek-v3; do
  echo "== 2. bench $p"
  timeout 200 torchrun --nproc_per_node "$NGPU" -m megamoe bench --preset "$p" --tokens 4096 --backends "$SPLITS" \
    --cuda-graph --iters 10 --warmup 3 --quiet --json "$OUT/bench-$p-4096.json" 2>&1 | quiet | tail -9
done
[ "${1:-}" = quick ] && exit 0

echo "== 3. bench-comm (dispatch, combine, presum combine vs NCCL)"
timeout 150 torchrun --nproc_per_node "$NGPU" -m megamoe bench-comm --sms 24,32 --iters 20 \
  --json "$OUT/comm.json" 2>&1 | quiet | grep -E "dispatch|combine|nccl" | tail -24

echo "== 4. profile split (qwen3, 4096 tokens/GPU)"
timeout 120 torchrun --nproc_per_node "$NGPU" benchmarks/profile_layer.py --preset qwen3-30b-a3b --tokens 4096 \
  --backend split --out "$OUT" 2>&1 | quiet | tail -30

echo "== 5. the rest of the GPU tests"
timeout 300 python3 -m pytest -q -m gpu tests 2>&1 | grep -v "^frame\|^E *frame" > "$OUT/gpu_all.log"
grep -E "passed|failed" "$OUT/gpu_all.log" | tail -3
