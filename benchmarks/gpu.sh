#!/usr/bin/env bash
# The GPU runner: named scenarios for one device call (one H200 unless said), logs under $OUT, a short summary last.
#   bash benchmarks/gpu.sh tests,bench
# Scenarios:
#   twins   every Hopper default kernel against its Triton twin on every preset's EP-4 share (tests/test_gpu_twins.py,
#           one pytest process per preset); summary table and $OUT/twins-<preset>.json
#   tests   every GPU test (pytest -m gpu), in parallel chunks (compiles are CPU-bound; 16 cores), with every checked
#           error recorded (MEGAMOE_ERRLOG), then the worst error per quantity: what the CUDA bounds of
#           megamoe.testing.BOUNDS and tests/test_grouped_gemm.py are set from
#   shared  the GPU tests of several ranks (EP 2-4: the fused, split and torch layers, their sync-free and graphed
#           steps, the FP8 presum case, graphed training) on ranks sharing this GPU (MEGAMOE_SHARE_GPUS=1: real
#           cross-process device memory, not NVLink, never speed); `tests` skips them on one GPU
#   bench   megamoe bench --experts E/4 --tokens 4096 (or BENCH_TOKENS) --cuda-graph --interleave for qwen3-30b-a3b
#           (32), deepseek-v3 (64), mixtral-8x7b (2); with BASE=<dir holding another tree's megamoe/> that tree too,
#           runs alternating (new, base, new, base), then a table of new / base per backend and mode
#           (benchmarks/ab_table.py)
#   peers   the same at 1, 512 and 4096 tokens with --peers (transformers' modules beside the backends; no base), and
#           SonicMoE where .whl/sonic/ holds its wheels (benchmarks/sonic_wheels.sh; carry .whl)
#   gemm    megamoe bench-gemm at the EP-4 shapes, 4096 and 16384 tokens per GPU
#   profile benchmarks/graph_profile.py: per-kernel device times of a graphed forward and forward+backward (qwen3,
#           deepseek, mixtral); with BASE=<dir> (its megamoe/ and benchmarks/graph_profile.py) that tree's forward on
#           deepseek and mixtral; an eager step's host time against its kernels' (qwen3, 512 tokens)
#   train   a short megamoe train (torch, split, split:fp8=1, fused; qwen3-30b-a3b dims, 2 layers), then
#           examples/hf_train.py (a transformers Qwen3-MoE, 4 layers, as transformers runs it and patched)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SCEN=",${1:-twins},"
want() { [[ "$SCEN" == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
SUMMARY=""

par_pytest() {  # par_pytest <name> <timeout s> <selection per process, ';'-separated> [extra pytest args]
  local name=$1 tmo=$2 IFS=';' i=0 pids=()
  for sel in $3; do
    # shellcheck disable=SC2086  # the selection is several pytest args
    ( IFS=' '; export MEGAMOE_TWINS_JSON=${MEGAMOE_TWINS_JSON:+$MEGAMOE_TWINS_JSON.$i}
      timeout "$tmo" python3 -m pytest -q -p no:cacheprovider -m gpu $sel "${@:4}" > "$OUT/$name-$i.log" 2>&1 ) &
    pids+=($!); i=$((i + 1))
  done
  wait "${pids[@]}"
  for f in "$OUT/$name"-*.log; do echo "-- $f: $(grep -E '[0-9]+ (passed|failed|error)' "$f" | tail -1)"; done
}

if want twins; then
  echo "== twins"
  IFS=',' read -ra PRESETS <<< "${TWIN_PRESETS:-qwen3-30b-a3b,deepseek-v3,mixtral-8x7b,gpt-oss-120b}"
  for p in "${PRESETS[@]}"; do
    ( MEGAMOE_TWINS_JSON="$OUT/twins-$p.json" timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_gpu_twins.py -k "$p" > "$OUT/twins-$p.log" 2>&1 ) &
  done
  wait
  for p in "${PRESETS[@]}"; do
    line=$(grep -E '[0-9]+ (passed|failed)' "$OUT/twins-$p.log" | tail -1)
    echo "-- twins $p: $line"; SUMMARY+="twins $p: $line"$'\n'
    grep -E "^(FAILED|ERROR)" "$OUT/twins-$p.log" | head -5
  done
fi

if want tests; then
  echo "== tests"
  rm -f "$OUT/errors.jsonl"
  ids=$(python3 -m pytest -q -p no:cacheprovider --collect-only -m gpu 2>/dev/null | grep "::")
  # the twins (module fixtures shared by a preset's cases) in 3 contiguous chunks, every other test dealt round-robin
  # over 7 (an H200) or 4 (an 80 GB card, where 7 ran out of memory), so that one file's heavy neighbours (the fused
  # and split layer cases) run apart
  nrest=$(python3 -c "import torch; print(7 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 4)")
  sels=$(echo "$ids" | NREST=$nrest python3 -c "
import os, sys
ids, n = sys.stdin.read().split(), int(os.environ['NREST'])
tw = [i for i in ids if 'test_gpu_twins.py' in i]
rest = [i for i in ids if 'test_gpu_twins.py' not in i]
per = -(-len(tw) // 3)
chunks = [tw[k * per:(k + 1) * per] for k in range(3)] + [rest[k::n] for k in range(n)]
print(';'.join(' '.join(c) for c in chunks if c))")
  echo "$(echo "$ids" | wc -l) GPU tests in $((3 + nrest)) processes"
  MEGAMOE_ERRLOG="$OUT/errors.jsonl" MEGAMOE_TWINS_JSON="$OUT/twins-tests.json" \
    par_pytest tests "${TESTS_TIMEOUT:-540}" "$sels" -v -v -rfE --durations=10
  SUMMARY+=$(for f in "$OUT"/tests-*.log; do grep -E '[0-9]+ (passed|failed|error)' "$f" | tail -1; done)$'\n'
  python3 - "$OUT/errors.jsonl" <<'EOF'
import collections, json, sys
worst = collections.defaultdict(float)
for line in open(sys.argv[1]):
    r = json.loads(line)
    worst[r["key"]] = max(worst[r["key"]], r["err"])
for k in sorted(worst):
    print(f"{k:<44} {worst[k]:10.3g}  x1.3 {1.3 * worst[k]:10.3g}")
EOF
fi

if want shared; then
  echo "== shared"
  # five processes side by side, each running its cases in order
  F=tests/test_gpu_fused.py S=tests/test_gpu_split.py
  MEGAMOE_SHARE_GPUS=1 par_pytest shared 560 "$F::test_fused_on_gpus $F::test_fused_triton_items_on_hopper;\
$F::test_fused_sync_free $F::test_fused_graph_capturable $F::test_fused_triton_items_sync_free_and_graph_capturable\
 $F::test_fused_completes_with_more_programs_than_resident_two_ranks;$S::test_split_on_gpus;$S::test_split_sync_free\
 $S::test_split_graph_capturable $S::test_split_fp8_presum_sync_free_and_graph_capturable\
 $S::test_split_fp8_copies_kept_by_the_optimizer;tests/test_gpu_layer.py::test_torch_backend_on_gpus\
 tests/test_gpu_train.py::test_graphed_moe_layers_train_like_eager" -rfE
  SUMMARY+=$(for f in "$OUT"/shared-*.log; do grep -E '[0-9]+ (passed|failed|error)' "$f" | tail -1; done)$'\n'
fi

BENCH_SET=${BENCH_SET:-"qwen3-30b-a3b:32 deepseek-v3:64 mixtral-8x7b:2"}
bench_one() {  # bench_one <tree> <preset> <experts> <tokens> <json> [more bench args]
  ( cd "$1" && PYTHONPATH=.:$PYTHONPATH timeout 560 python3 -m megamoe bench --preset "$2" --experts "$3" --tokens "$4" \
      --cuda-graph --interleave --quiet --json "$5" "${@:6}" )
}

if want bench; then
  echo "== bench"
  for pe in $BENCH_SET; do
    p=${pe%%:*}; e=${pe##*:}
    for r in 1 2; do
      bench_one . "$p" "$e" "${BENCH_TOKENS:-4096}" "$OUT/bench-$p-new$r.json" > "$OUT/bench-$p-new$r.log" 2>&1
      tail -8 "$OUT/bench-$p-new$r.log"
      if [ -n "${BASE:-}" ]; then
        bench_one "$BASE" "$p" "$e" "${BENCH_TOKENS:-4096}" "$OUT/bench-$p-base$r.json" \
          > "$OUT/bench-$p-base$r.log" 2>&1
        tail -8 "$OUT/bench-$p-base$r.log"
      fi
    done
  done
  SUMMARY+=$(python3 benchmarks/ab_table.py "$OUT")$'\n'
fi

if want peers; then
  echo "== peers"
  if [ -d .whl/sonic ]; then  # SonicMoE as a peer (benchmarks/sonic_wheels.sh made them; carried as .whl)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/sonic/*.whl
    python3 -c "import tarfile; tarfile.open('.whl/sonic/cutlass_dsl_libs_base.tar.xz').extractall('/tmp/site')"
    sonic=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages  # its .pth, by hand
    # its first calls alone, bounded, with the Python stacks every 60 s: quack compiles and autotunes every GEMM on
    # first use (silent, ~90 CuTe DSL compiles tuned: more than one device call), so by default its one default config
    # (MEGAMOE_SONIC_TUNE=default, named sonicmoe-untuned; =all tunes), compiled in-process (QUACK_COMPILE_WORKERS=1:
    # quack 0.4.1's workers answer over their stdout, which the DSL's prints can wedge), each compile logged; the
    # benches get SonicMoE only if these finish, and share the probe's kernel and tuning caches
    export QUACK_CACHE_DIR=/tmp/quack_cache QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-1} \
      MEGAMOE_SONIC_TUNE=${MEGAMOE_SONIC_TUNE:-default} CUTE_DSL_ARCH=sm_90a
    if PYTHONPATH=$PYTHONPATH:$sonic QUACK_PRINT_AUTOTUNING=1 CUTE_DSL_LOG_TO_CONSOLE=1 CUTE_DSL_LOG_LEVEL=20 \
        CUTE_DSL_JIT_TIME_PROFILING=1 timeout "${SONIC_PROBE_S:-420}" python3 - > "$OUT/sonic-probe.log" 2>&1 <<'EOF'
import faulthandler, os, signal, sys, threading, time
import torch
faulthandler.dump_traceback_later(60, repeat=True, file=sys.stdout)
faulthandler.register(signal.SIGTERM, file=sys.stdout, chain=True)  # where it was when timeout stopped it
t0 = time.time()
def watch():  # CPU time rising: compiling; flat, with the stacks in quack's _recv: wedged
    while not time.sleep(30):
        print(f"[{time.time() - t0:.0f} s] process CPU {sum(os.times()[:4]):.0f} s", flush=True)
threading.Thread(target=watch, daemon=True).start()
import sonicmoe
from megamoe import preset
from megamoe.apps.peers import SonicPeer
from megamoe.layer import MoE
print("sonicmoe", sonicmoe.__version__, flush=True)
cfg = preset("qwen3-30b-a3b", num_experts=32, max_tokens_per_rank=512)
moe = MoE(cfg, backend="torch", device="cuda", seed=0)
peer = SonicPeer(moe)
x = torch.randn(512, cfg.hidden, device="cuda", dtype=cfg.dtype, requires_grad=True)
for i in range(3):
    t = time.perf_counter()
    y = peer(x).out
    y.float().sum().backward()
    torch.cuda.synchronize()
    print(f"forward+backward {i}: {time.perf_counter() - t:.2f} s", flush=True)
t = time.perf_counter()
with torch.no_grad():  # the inference form (no pre-activation kept) is a kernel of its own
    peer(x.detach())
torch.cuda.synchronize()
print(f"no-grad forward: {time.perf_counter() - t:.2f} s", flush=True)
ref = moe(x.detach()).out.float()
print(f"error against the torch backend: {((y.float() - ref).norm() / ref.norm()).item():.2e}")
EOF
    then export PYTHONPATH=$PYTHONPATH:$sonic
    else echo "SonicMoE left out: its first calls did not finish (sonic-probe.log)"
    fi
    tail -5 "$OUT/sonic-probe.log"
  fi
  for pe in $BENCH_SET; do
    for t in ${PEER_TOKENS:-1 512 4096}; do
      p=${pe%%:*}; e=${pe##*:}
      bench_one . "$p" "$e" "$t" "$OUT/peers-$p-$t.json" --peers > "$OUT/peers-$p-$t.log" 2>&1
      tail -9 "$OUT/peers-$p-$t.log"
    done
  done
fi

if want gemm; then
  echo "== gemm"
  timeout 560 python3 -m megamoe bench-gemm --tokens 4096 16384 --json "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1
  tail -40 "$OUT/gemm.log"
fi

if want profile; then
  echo "== profile"
  for pe in qwen3-30b-a3b:32 deepseek-v3:64 mixtral-8x7b:2; do
    p=${pe%%:*}
    for mode in forward forward+backward; do
      m=${mode/+/-}  # file names: letters, digits, '.', '_' and '-' only (what the device tool returns)
      timeout 120 python3 benchmarks/graph_profile.py --preset "$p" --experts "${pe##*:}" --mode "$mode" --backends split,fused \
          > "$OUT/profile-$p-$m-new.log" 2>&1
      grep -A14 "^==" "$OUT/profile-$p-$m-new.log"
      # the other tree's forward where split's graphed forward lost to it (its own graph_profile.py, under torchrun:
      # older trees need a group; its fused default was the Triton megakernel, so Gluon is asked for)
      if [ -n "${BASE:-}" ] && [ "$mode" = forward ] && [ "$p" != qwen3-30b-a3b ]; then
        ( cd "$BASE" && PYTHONPATH=. timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
            benchmarks/graph_profile.py --preset "$p" --experts "${pe##*:}" --mode "$mode" --backends split,fused:kernel=gluon \
            > "$OUT/profile-$p-$m-base.log" 2>&1 )
        grep -A14 "^==" "$OUT/profile-$p-$m-base.log"
      fi
    done
  done
  # eager: the host's time per step against the kernels' (eager steps below 4096 tokens are launch-bound)
  timeout 120 python3 benchmarks/graph_profile.py --preset qwen3-30b-a3b --experts 32 --tokens 512 \
      --mode forward+backward --backends split,fused --eager > "$OUT/profile-eager.log" 2>&1
  grep -A14 "^==" "$OUT/profile-eager.log"
fi

if want train; then
  echo "== train"
  timeout 300 python3 -m megamoe train --backends torch,split,fused --fp8 --preset qwen3-30b-a3b --layers 2 \
      --steps 30 --out "$OUT/train" > "$OUT/train.log" 2>&1
  tail -15 "$OUT/train.log"
  timeout 250 python3 examples/hf_train.py --steps 60 --json "$OUT/hf_train.json" --png "$OUT/hf_train.png" \
      > "$OUT/hf_train.log" 2>&1
  tail -8 "$OUT/hf_train.log"
fi

echo "== summary"
printf "%s" "$SUMMARY"
# the device tool returns at most 8 files from $OUT: past that, everything goes into one archive
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar czf /tmp/gpu-logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu-logs.tgz "$OUT/logs.tgz"
fi
