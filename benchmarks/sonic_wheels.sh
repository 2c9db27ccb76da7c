#!/usr/bin/env bash
# SonicMoE for `megamoe bench --peers` on the GPU machine, which has no network: run this where pip reaches PyPI. It
# leaves .whl/sonic/ (git-ignored, ~57 MB: carry `.whl` to the device) holding the wheels, and the CUTLASS DSL
# libraries repacked with xz, since their 74 MB wheel alone exceeds the device tool's 64 MiB working tree.
# benchmarks/gpu.sh installs them into /tmp/site when .whl/sonic/ is there.
# Versions: sonic-moe 0.1.2.post1 pins nvidia-cutlass-dsl 4.4.2, and quack-kernels 0.4.1 is the newest that accepts it.
set -eu
D=.whl/sonic
mkdir -p "$D"
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d "$1" "${@:2}"
}
get "$D" sonic-moe==0.1.2.post1 quack-kernels==0.4.1 nvidia-cutlass-dsl==4.4.2 apache-tvm-ffi==0.1.15.post2 \
  torch-c-dlpack-ext==0.1.5
tmp=$(mktemp -d)
get "$tmp" nvidia-cutlass-dsl-libs-base==4.4.2
(cd "$tmp" && mkdir x && cd x && python3 -m zipfile -e ../nvidia_cutlass_dsl_libs_base-*.whl . && tar cf - . | xz -9 -T0) \
  > "$D/cutlass_dsl_libs_base.tar.xz"
rm -rf "$tmp"
du -sh "$D"
