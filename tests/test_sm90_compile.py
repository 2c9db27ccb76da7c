"""Every Triton and Gluon kernel of the split and fused layers, compiled for Hopper (sm_90a) on the CPU with the
specialisation its real launch gets (megamoe/testing/sm90.py): what the interpreter cannot see.

- everything compiles, including with one token per rank, one rank and one local expert (the launcher turns an
  int argument equal to 1 into a constexpr; ``ntok.to(...)`` then failed to compile on the H200);
- no kernel moves data through global memory 1 or 2 bytes at a time: what a row pointer loaded from the
  heap's table without an alignment hint produced in the fused megakernel (its GEMM2 epilogue and combine);
- the GEMM-bound kernels and the router's do not spill registers beyond MAX_SPILL bytes per thread (the first
  Triton router spilled 36-84 bytes and took 28 us on qwen3 against 11 without);
- ptxas serialises no kernel's wgmmas (warning C751x); the FP8 SwiGLU backward keeps a wgmma in flight and
  promotes under it in the SASS; every Gluon GEMM variant (megamoe.testing.sm90's *_VARIANTS) compiles within its
  spill and shared-memory bounds with its epilogue's stores as designed.
Runs the layers under megamoe.testing.sm90.compile_only on 2 gloo ranks in a subprocess without TRITON_INTERPRET
(3-6 minutes on 2 cores with a cold Triton cache). Rank 1 runs every two-rank layer after rank 0 and compiles only
what rank 0 did not: nothing, since the communication kernels take ``rank`` unspecialised
(test_no_kernel_is_specialised_per_rank).
"""

from __future__ import annotations

import pytest

from megamoe.testing.sm90 import run_report_subprocess

NO_SPILLS = ("_fused_fwd_kernel", "_grouped_gemm_kernel", "_grouped_gemm_fp8_kernel", "_grouped_wgrad_kernel",
             "_gluon_fp8_dswiglu_kernel", "_route_fwd_kernel", "_route_bwd_kernel")


@pytest.fixture(scope="module")
def rep():
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        get_ptxas(90)
    except Exception as exc:  # noqa: BLE001 - a triton wheel without its bundled ptxas: nothing to compile with
        pytest.skip(f"no ptxas for sm_90a in this triton install: {exc}")
    return run_report_subprocess()


def test_every_layer_kernel_compiles_for_hopper(rep):
    names = {k.split("#")[0] for k in rep}
    for expected in ("_stage_kernel", "_pull_kernel", "_fused_fwd_kernel", "_gluon_fused_fwd_kernel",
                     "_fused_tail_kernel", "_publish_done_kernel", "_grouped_gemm_kernel", "_grouped_gemm_fp8_kernel",
                     "_grouped_wgrad_kernel", "_gather_sum_kernel", "_presum_stage_kernel", "_send_dw_kernel"):
        assert expected in names, f"{expected} was never launched by the layers under compile_only"
    one_token = [k for k, v in rep.items() if "/1tok/" in v["layer"]]
    assert any(k.startswith("_stage_kernel") for k in one_token), "the one-token stage kernel was not compiled"
    assert any(v["layer"].startswith("W1/") for v in rep.values()), "nothing compiled for one rank"


def test_no_narrow_global_accesses(rep):
    # (the bf16 ws kernel's "masked" variant stores rows of 7164 bf16, not 16-byte aligned, on purpose)
    narrow = {k: {op: n for kind in ("ld", "st") for op, n in v[kind].items() if op.endswith((".b16", ".u16",
                                                                                                ".b8", ".u8"))}
              for k, v in rep.items() if not v["layer"].endswith("/masked")}
    narrow = {k: v for k, v in narrow.items() if v}
    assert not narrow, f"1- or 2-byte global accesses (a row pointer without an alignment hint?): {narrow}"


def test_shared_memory_fits_hopper(rep):
    # 227 KB per CTA on sm_90; compile_only launches nothing, so the GPU's "out of resource: shared memory" would
    # otherwise first show on the device (the default wgrad with a float32 output did)
    assert any(v["layer"].startswith("wgrad/default/float32") for v in rep.values()), "float32 wgrad not compiled"
    over = {k: (v["layer"], v["shared_bytes"]) for k, v in rep.items() if v["shared_bytes"] > 232448}
    assert not over, f"kernels needing more shared memory than a Hopper SM gives one CTA: {over}"


#: bytes per thread a GEMM-bound kernel may spill: the dgrad2+SwiGLU epilogue that also writes the gated activation
#: (the bf16 backward's acts_out) spills 2-4 bytes at its default 2 epilogue slices and timed as fast as without the
#: output on an H200, while 4 slices, without the spill, were 4-10% slower. The spills this test caught were
#: 36-456 bytes.
MAX_SPILL = 8



def test_gemm_kernels_do_not_spill(rep):
    spills = {k: v["spill_store_bytes"] for k, v in rep.items() if k.split("#")[0] in NO_SPILLS
              and v["spill_store_bytes"] > MAX_SPILL}
    assert not spills, f"register spills (bytes stored per thread): {spills}"
    from megamoe.testing.sm90 import ROUTER_CASES

    router = {v["layer"] for k, v in rep.items() if k.startswith("_route_")}
    assert router == {f"router/{c[0]}" for c in ROUTER_CASES}, f"router kernels compiled for: {sorted(router)}"


def test_no_kernel_serialises_its_wgmmas(rep):
    # ptxas warning C751x: wgmmas serialised (a wait after every one, whatever the PTX's wait_group says); the first
    # version of the Gluon FP8 kernel had it (C7514: an in-flight product carried across the loop's back edge) while
    # its PTX looked pipelined
    serial = {k: (v["layer"], v["wgmma_serialized"]) for k, v in rep.items() if v["wgmma_serialized"]}
    assert not serial, f"ptxas serialised the wgmmas of: {serial}"


def test_gluon_fp8_dswiglu_keeps_a_wgmma_in_flight(rep):
    # the point of the Gluon FP8 SwiGLU backward: promotions run while the next wgmma is in flight (wait_group 1 in
    # the k-loop, not serialised by ptxas), where the Triton FP8 kernel waits for every wgmma (wait_group 0 only).
    # In the SASS (ptxas moves a wait above the independent FMAs of its basic block) one of its two promotions per
    # pair of k-steps runs under a wgmma
    from megamoe.testing.sm90 import DSWIGLU_VARIANTS

    got = {v["layer"]: v for k, v in rep.items() if k.startswith("_gluon_fp8_dswiglu_kernel")}
    variants = {f"gluon-fp8-dswiglu/{label}": cfg for label, cfg, *_ in DSWIGLU_VARIANTS}
    assert set(got) == set(variants), f"FP8 SwiGLU backward variants: {sorted(got)}, expected {sorted(variants)}"
    for label, v in got.items():
        assert "1" in v["wgmma_wait_groups"], f"{label}: no wgmma.wait_group 1 {v['wgmma_wait_groups']}"
        assert not v["wgmma_serialized"], f"{label}: ptxas serialised its wgmmas"
        assert v["spill_store_bytes"] == 0, f"{label}: spills {v['spill_store_bytes']} bytes per thread"
        bm, bn, _, warps = variants[label]
        tile = bm * bn // (32 * warps)  # FMAs per thread of one promotion
        assert v["ffma_under_wgmma"] >= tile, f"{label}: {v['ffma_under_wgmma']} FFMAs under a wgmma"


#: bytes per thread the warp-specialised FP8 kernel's variants may spill (its consumers run at 232-240 registers, the
#: loader at 24-40): with the TMA-store epilogue the 128 + 128-column SwiGLU tile spills 0, the plain 256-column tile
#: 24 B at 64 experts (232 registers); a regression to hundreds of bytes fails
WS_MAX_SPILL = 128


def test_gluon_fp8_ws_variants(rep):
    # every variant compiles, ptxas serialises no wgmma, shared memory fits, spills stay bounded; the producer /
    # consumer split is real: three register budgets (setmaxnreg) in the PTX is not checked here, but the loader's
    # TMA copies and the consumers' wgmmas are (both present)
    from megamoe.testing.sm90 import WS_VARIANTS

    ws = {v["layer"]: v for k, v in rep.items() if k.startswith("_gluon_fp8_ws_kernel")}
    want = {f"gluon-fp8-ws/{c[0]}" for c in WS_VARIANTS}
    assert set(ws) == want, f"warp-specialised variants compiled: {sorted(ws)}, expected {sorted(want)}"
    for label, v in ws.items():
        assert not v["wgmma_serialized"], f"{label}: ptxas serialised its wgmmas"
        assert v["spill_store_bytes"] <= WS_MAX_SPILL, f"{label}: spills {v['spill_store_bytes']} bytes per thread"
        assert v["shared_bytes"] <= 232448, f"{label}: {v['shared_bytes']} bytes of shared memory"
        assert "0" in v["wgmma_wait_groups"], f"{label}: no wgmma wait {v['wgmma_wait_groups']}"
        # the epilogue: TMA stores (every variant's output is TMA-able) and the masked 16-byte stores of half tiles
        # that cross an expert's end
        assert v["tma_stores"] > 0, f"{label}: no TMA stores"
        assert v["st"].get("st.global.v4.b32", 0) > 0, f"{label}: no 16-byte masked stores {v['st']}"


def test_gluon_bf16_ws_variants(rep):
    # the warp-specialised bf16 GEMM: chained async wgmmas (wait_group 1; SwiGLU 2), not serialised, shared memory
    # within 227 KB; no spills but the SwiGLU backward's epilogue with acts (44-48 B at 240 consumer registers); the
    # epilogue: TMA stores where the output allows them (besides the masked 16-byte stores of partial tiles), none
    # where it does not (N = 7164: rows not 16-byte aligned); the SwiGLU backward reads h by TMA (no vector global
    # loads: only the schedule and the scale are loaded)
    from megamoe.testing.sm90 import WS_BF16_VARIANTS

    ws = {v["layer"]: v for k, v in rep.items() if k.startswith("_gluon_bf16_ws_kernel")}
    variants = {f"gluon-bf16-ws/{c[0]}": c for c in WS_BF16_VARIANTS}
    assert set(ws) == set(variants), f"bf16 ws variants compiled: {sorted(ws)}, expected {sorted(variants)}"
    for label, v in ws.items():
        _, epi, _, _, _, _, aligned = variants[label]
        want = "2" if epi == 1 else "1"
        if epi == 2:
            assert set(v["ld"]) <= {"ld.global.b32"}, f"{label}: h read from global memory? {v['ld']}"
        assert want in v["wgmma_wait_groups"], f"{label}: no wgmma.wait_group {want} {v['wgmma_wait_groups']}"
        assert not v["wgmma_serialized"], f"{label}: ptxas serialised its wgmmas"
        allowed = 64 if epi == 2 and "acts" in label else 0
        assert v["spill_store_bytes"] <= allowed, f"{label}: spills {v['spill_store_bytes']} bytes"
        assert v["shared_bytes"] <= 232448, f"{label}: {v['shared_bytes']} bytes of shared memory"
        assert (v["tma_stores"] > 0) == aligned, f"{label}: {v['tma_stores']} TMA stores"
        if aligned:
            assert v["st"].get("st.global.v4.b32", 0) > 0, f"{label}: no 16-byte masked stores {v['st']}"


def test_gluon_wgrad_ws_variants(rep):
    # the warp-specialised wgrad (the default for grouped_wgrad on Hopper): every variant compiles, its wgmmas are
    # chained (wait_group 1) and not serialised (an A operand in registers made ptxas serialise them: C7512), no
    # spills (168 registers), shared memory within 227 KB, the epilogue stores by TMA
    from megamoe.testing.sm90 import WGRAD_WS_VARIANTS

    ws = {v["layer"]: v for k, v in rep.items() if k.startswith("_gluon_wgrad_ws_kernel")}
    want = {f"gluon-wgrad-ws/{c[0]}" for c in WGRAD_WS_VARIANTS}
    assert set(ws) == want, f"wgrad ws variants compiled: {sorted(ws)}, expected {sorted(want)}"
    for label, v in ws.items():
        assert "1" in v["wgmma_wait_groups"], f"{label}: no wgmma.wait_group 1 {v['wgmma_wait_groups']}"
        assert not v["wgmma_serialized"], f"{label}: ptxas serialised its wgmmas"
        assert v["spill_store_bytes"] == 0, f"{label}: spills {v['spill_store_bytes']} bytes per thread"
        assert v["shared_bytes"] <= 232448, f"{label}: {v['shared_bytes']} bytes of shared memory"
        assert v["tma_stores"] > 0, f"{label}: no TMA stores"


# the Gluon items in all (56 B with h on 8 experts, all of it the loader's: it reloads the parameter base for each TMA
# issue into a spilled register pair, 32 B in its region and 24 B in its out-of-line paths for a diverged warp; the
# consumers 0 B)
GLUON_FUSED_MAX_SPILL = 64


def test_gluon_fused_items_compile_pipelined(rep):
    # the Gluon items (kernels/gluon/fused.py, the fused backend's choice on Hopper): dense with h (world 1), a ring
    # and one token (world 2) compile; the consumers keep wgmma groups in flight (GEMM1: wait_group 2, the gate and
    # up groups; GEMM2: 1) and spill at most MAX_SPILL; GEMM1's epilogue stores by TMA; the tail runs as its own
    # kernel
    from megamoe.kernels.gluon.fused import CONSUMER_REGS

    gl = {v["layer"]: v for k, v in rep.items() if k.startswith("_gluon_fused_fwd_kernel")}
    assert any("items=gluon" in lay and lay.startswith("W1/") for lay in gl), f"dense variant missing: {list(gl)}"
    assert any("ring_blocks=8" in lay for lay in gl), f"ring variant missing: {list(gl)}"
    for lay, v in gl.items():
        waits = v["wgmma_wait_groups"]
        assert waits.get("2", 0) >= 1 and waits.get("1", 0) >= 1, f"{lay}: wgmma waits {waits}"
        by_regs = v["spill_store_bytes_by_regs"]
        if by_regs is None:  # (no cuobjdump: the kernel's total)
            assert v["spill_store_bytes"] <= MAX_SPILL, f"{lay}: spills {v['spill_store_bytes']} B"
        else:  # the consumers' code (their setmaxnreg region) spills at most MAX_SPILL, the kernel in all
            # GLUON_FUSED_MAX_SPILL (the loader's)
            consumers = sum(n for r, n in by_regs.items() if int(r) >= CONSUMER_REGS)
            assert consumers <= MAX_SPILL, f"{lay}: the consumers spill {consumers} B ({by_regs})"
            assert v["spill_store_bytes"] <= GLUON_FUSED_MAX_SPILL, f"{lay}: spills {v['spill_store_bytes']} B"
        assert v["tma_stores"] > 0, f"{lay}: no TMA stores"
    assert any(k.startswith("_fused_tail_kernel") for k in rep), "the Gluon path's tail kernel was not compiled"


def test_no_kernel_is_specialised_per_rank(rep):
    # rank 1 runs every two-rank layer after rank 0 (megamoe.testing.sm90._layer_rank): a kernel it compiles anew was
    # specialised on something that differs between the ranks (the ``rank`` argument once was: a constexpr 1 on
    # rank 1, a multiple of 16 on rank 0), so every rank of a job compiles its own copy
    own = {k: v["layer"] for k, v in rep.items() if v["rank"] > 0}
    assert not own, f"kernels rank 1 compiled that rank 0 did not (an argument specialised per rank?): {own}"


def test_flags_published_after_a_cta_barrier(rep):
    # the stage kernel's token count is stored by one thread and READY published by the lanes (one per peer): a
    # bar.sync between them, or the peers may read a stale count (megamoe.testing.sm90.unfenced_publishes)
    assert any(k.startswith("_stage_kernel") for k in rep)
    bad = {k: v["unfenced_publishes"] for k, v in rep.items() if v["unfenced_publishes"]}
    assert not bad, f"flags published with no CTA barrier after another thread's store: {bad}"


def test_every_bounded_wait_traps(rep):
    # fail-stop: a kernel whose wait fails traps (comm/signals.fail_stop) rather than going on with unwritten inputs
    waits = {k for k, v in rep.items() if v["bounded_waits"]}
    assert any(k.startswith("_fused_fwd_kernel") for k in waits) and any(k.startswith("_gluon_fused_fwd_kernel")
                                                                          for k in waits)
    no_trap = sorted(k for k in waits if not rep[k]["traps"])
    assert not no_trap, f"kernels with bounded waits but no trap: {no_trap}"
