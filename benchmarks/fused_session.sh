#!/usr/bin/env bash
# One device call for the fused backend: layer bench (torch, best split, fused variants) on qwen3 and deepseek,
# the fused GPU tests, the pull sweep and the split FP8 GPU test. Writes logs and JSON under $OUT.
#   usage (device tool):  MEGAMOE_COMMIT=<sha> bash benchmarks/fused_session.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out/fused_session}
mkdir -p "$OUT"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
quiet() { grep -v "^W1\|OMP_NUM\|^\*\*\*\*\|UserWarn\|_warn_once" ; }
BACKENDS="torch,split:presum_combine=1:overlap_backward=1,fused,fused:group_blocks=1,fused:group_blocks=8,fused:ring_blocks=64"
for p in qwen3-30b-a3b deepseek-v3; do
  echo "== bench $p (W=$NGPU)"
  timeout 150 torchrun --nproc_per_node "$NGPU" -m megamoe bench --preset "$p" --tokens 4096 --backends "$BACKENDS" \
    --iters 10 --warmup 3 --quiet --json "$OUT/bench-$p-4096-ep$NGPU.json" 2>&1 | quiet | tail -9
done
echo "== fused GPU tests (2 ranks, sync-free, graph)"
timeout 200 python3 -m pytest -q -x -m gpu tests/test_gpu_fused.py -k "gpus and 2 or sync or graph" 2>&1 \
  | grep -v "^frame\|^E *frame" > "$OUT/gpu_fused.log"; grep -E "passed|failed|Error|assert" "$OUT/gpu_fused.log" | tail -6
echo "== pull sweep"
timeout 100 torchrun --nproc_per_node "$NGPU" benchmarks/pull_sweep.py --programs 32,132 --json "$OUT/pull_sweep.json" \
  2>&1 | quiet | tail -16
echo "== split fp8 GPU test"
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_split.py -k fp8 2>&1 | grep -v "^frame" > "$OUT/gpu_fp8.log"
grep -E "passed|failed|Error|assert" "$OUT/gpu_fp8.log" | tail -4
