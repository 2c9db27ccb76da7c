"""Pieces the Hopper (sm_90a) Gluon kernels share: the tile schedule read on the device (kernels/tiles.py's,
restated with Gluon layouts because a Gluon kernel cannot call a Triton @jit helper: keep the two in step), the TMA
ring of the warp-specialised kernels (one loader warp feeding two consumer warpgroups through ready / empty
mbarriers), and the staged TMA-store epilogue (``put``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.kernels.gemm_config import SMEM_LIMIT

REG_POOL = 504  # registers per thread summed over the three warpgroups (168 each: 65536 / 384 threads, a multiple of 8)


def nvmma_desc(t, block: list[int], dtype=gl.bfloat16, shape: list[int] | None = None) -> TensorDescriptor:
    """A TMA descriptor over t (unit inner stride; ``shape``: its extent, default t's) with blocks ``block`` in their
    default NVMMA shared layout."""
    return TensorDescriptor(t, list(t.shape) if shape is None else shape, list(t.stride()), block,
                            gl.NVMMASharedLayout.get_default_for(block, dtype))


def stages_reason(cfg, smem: int) -> str | None:
    """Why ``cfg``'s ring cannot be used (fewer than 2 stages, or ``smem`` bytes over SMEM_LIMIT), or None."""
    if cfg.num_stages < 2:
        return f"num_stages must be >= 2, got {cfg.num_stages}"
    if smem > SMEM_LIMIT:
        return f"{cfg.num_stages} stages need ~{smem} bytes of shared memory, more than {SMEM_LIMIT}"
    return None


@gluon.jit
def add(a, b):
    return a + b


@gluon.jit
def schedule(offs_ptr, E_l, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_E: gl.constexpr,
              layout: gl.constexpr):
    """tiles.expert_tiles: per-expert row starts, counts, m-tile counts and running tile ends, the total tile count."""
    e_idx = gl.arange(0, BLOCK_E, layout=layout)
    emask = e_idx < E_l
    starts = gl.load(offs_ptr + e_idx, mask=emask, other=0)
    ends = gl.load(offs_ptr + e_idx + 1, mask=emask, other=0)
    cnts = gl.maximum(ends - starts, 0)
    m_tiles = (cnts + BLOCK_M - 1) // BLOCK_M
    tiles = m_tiles * gl.cdiv(N, BLOCK_N)
    cum_end = gl.associative_scan(tiles, 0, add)
    return e_idx, starts, cnts, m_tiles, cum_end, gl.sum(tiles, axis=0)


@gluon.jit
def locate(tile, e_idx, starts, cnts, m_tiles, cum_end, tiles_n, GROUP_M: gl.constexpr):
    """tiles.locate_tile: tile index -> (expert, its first row, its row end, m-block, n-block)."""
    e = gl.sum((cum_end <= tile).to(gl.int32), axis=0)
    sel = e_idx == e
    mt = gl.sum(gl.where(sel, m_tiles, 0), axis=0)
    t0 = gl.sum(gl.where(sel, cum_end, 0), axis=0) - mt * tiles_n
    row0 = gl.sum(gl.where(sel, starts, 0), axis=0)
    row_end = row0 + gl.sum(gl.where(sel, cnts, 0), axis=0)
    local = tile - t0
    width = GROUP_M * tiles_n
    first_m = (local // width) * GROUP_M
    gsz = gl.minimum(mt - first_m, GROUP_M)
    mi = first_m + (local % width) % gsz
    ni = (local % width) // gsz
    return e, row0, row_end, mi, ni


@gluon.jit
def halves(x, BLOCK_M: gl.constexpr, NP: gl.constexpr):
    """[BLOCK_M, NP] -> (cols 0..NP/2-1, cols NP/2..NP-1); in the wgmma layout with one warp along N the split bit is
    a register bit, so this moves no data."""
    x = gl.permute(gl.reshape(x, [BLOCK_M, 2, NP // 2]), (0, 2, 1))
    return gl.split(x)


@gluon.jit
def parts(x, BLOCK_M: gl.constexpr, NP: gl.constexpr, PARTS: gl.constexpr):
    """x [BLOCK_M, NP] -> PARTS (1, 2 or 4) column blocks in order (halves: register-only), padded to four with the
    first."""
    if PARTS == 1:
        s0, s1, s2, s3 = x, x, x, x
    elif PARTS == 2:
        s0, s1 = halves(x, BLOCK_M, NP)
        s2, s3 = s0, s0
    else:
        h0, h1 = halves(x, BLOCK_M, NP)
        s0, s1 = halves(h0, BLOCK_M, NP // 2)
        s2, s3 = halves(h1, BLOCK_M, NP // 2)
    return s0, s1, s2, s3


@gluon.jit
def slices(x, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, mma_s: gl.constexpr):
    """x [BLOCK_M, BLOCK_N] in the wgmma layout -> BLOCK_N // 64 (1, 2 or 4) slices [BLOCK_M, 64] in mma_s (the
    wgmma layout of a 64-column tile: the same registers), padded to four with the first slice."""
    s0, s1, s2, s3 = parts(x, BLOCK_M, BLOCK_N, BLOCK_N // 64)
    return (gl.convert_layout(s0, mma_s, assert_trivial=True), gl.convert_layout(s1, mma_s, assert_trivial=True),
            gl.convert_layout(s2, mma_s, assert_trivial=True), gl.convert_layout(s3, mma_s, assert_trivial=True))


@gluon.jit
def ring(STAGES: gl.constexpr, EMPTY_COUNT: gl.constexpr, READY_COUNT: gl.constexpr = 1):
    """The ring's barriers, initialised: ready[s] (the loader's TMA bytes of stage s landed; READY_COUNT arrivals)
    and empty[s] (its EMPTY_COUNT consumer warpgroups released it)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=READY_COUNT)
        mbarrier.init(empty.index(s), count=EMPTY_COUNT)
    return ready, empty


@gluon.jit
def ring_done(ready, empty, STAGES: gl.constexpr):
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


@gluon.jit
def ring_skip(ready, empty, it, k, STAGES: gl.constexpr):
    """A consumer warpgroup whose 64 rows all lie past the block's end takes the next k ring stages from ring count
    it, freeing each once landed, with no wgmma or epilogue, so the other consumer has the tensor cores to itself.
    It must wait for each stage: an empty barrier counts one arrival per consumer per pass, so an arrival ahead of
    the ring would complete a phase before the other consumer released the stage. Returns the new ring count."""
    for _ki in range(k):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        mbarrier.arrive(empty.index(s), count=1)
        it += 1
    return it


@gluon.jit
def put(val, desc, ptr, stride, row, col, row_end, N, epi_smem, buf, tma_ok, HM: gl.constexpr,
         EPI_TMA: gl.constexpr, store_l: gl.constexpr, NB: gl.constexpr = 2):
    """val ([HM, 64], accumulator layout) -> output rows row.., columns col.. through staging buffer buf: where
    tma_ok (every row belongs to the tile's expert; EPI_TMA: the output is TMA-able) by an asynchronous TMA store
    (drains under the next k-loop; columns >= N clipped by the descriptor), else read back in store_l and stored
    with a mask (TMA cannot stop at an expert's last row). A consumer's NB buffers are used in turn, so the store
    that last read buf is NB - 1 before the latest: store_wait(NB - 1), then a warpgroup barrier, frees it."""
    b = epi_smem.index(buf)
    if EPI_TMA:
        tma.store_wait(NB - 1)
    gl.thread_barrier()
    b.store(val)
    if EPI_TMA:
        if tma_ok:
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(desc, [row, col], b)
        else:
            masked_from(b, ptr, stride, row, col, row_end, N, HM, store_l)
    else:
        masked_from(b, ptr, stride, row, col, row_end, N, HM, store_l)


@gluon.jit
def masked_from(b, ptr, stride, row, col, row_end, N, HM: gl.constexpr, store_l: gl.constexpr):
    """The staged tile b [HM, 64] -> ptr[row + i, col + j] for rows < row_end, columns < N (16-byte stores)."""
    gl.thread_barrier()
    v = b.load(store_l)
    rm = row + gl.arange(0, HM, layout=gl.SliceLayout(1, store_l))
    rn = col + gl.arange(0, 64, layout=gl.SliceLayout(0, store_l))
    ptrs = ptr + rm.to(gl.int64)[:, None] * stride + rn[None, :]
    gl.store(ptrs, v, mask=(rm < row_end)[:, None] & (rn < N)[None, :])


@gluon.jit
def epi_tile(acc, acc2, off_m, off_n, row_end, N, out_desc, hg_desc, hu_desc, out_ptr, stride_om, h_ptr, stride_hm,
             scale_ptr, epi_smem, b0, tma_ok, HM: gl.constexpr, BLOCK_N: gl.constexpr, SWIGLU: gl.constexpr,
             STORE_H: gl.constexpr, HAS_SCALE: gl.constexpr, EPI_TMA: gl.constexpr, mma_s: gl.constexpr,
             store_l: gl.constexpr):
    """A consumer's [HM, BLOCK_N] tile stored in 64-column slices through put, each slice's first store on the buffer
    after the previous slice's last (b0 first): SWIGLU (acc the gate, acc2 the up products) h's gate and up
    (STORE_H), then act = silu(g) * u; else acc (HAS_SCALE: times scale[row])."""
    sl = slices(acc, HM, BLOCK_N, mma_s)
    us = slices(acc2, HM, BLOCK_N, mma_s)
    for c in gl.static_range(BLOCK_N // 64):
        col = off_n + 64 * c
        buf = b0 ^ (c % 2)
        if SWIGLU:
            g = sl[c]
            u = us[c]
            if STORE_H:
                put(g.to(gl.bfloat16), hg_desc, h_ptr, stride_hm, off_m, col, row_end, N, epi_smem, buf, tma_ok, HM,
                     EPI_TMA, store_l)
                put(u.to(gl.bfloat16), hu_desc, h_ptr + N, stride_hm, off_m, col, row_end, N, epi_smem, buf ^ 1,
                     tma_ok, HM, EPI_TMA, store_l)
            x = g / (1.0 + gl.exp(-g)) * u
        else:
            x = sl[c]
            if HAS_SCALE:
                rm = off_m + gl.arange(0, HM, layout=gl.SliceLayout(1, mma_s))
                x = x * gl.load(scale_ptr + rm, mask=rm < row_end, other=0.0)[:, None]
        put(x.to(gl.bfloat16), out_desc, out_ptr, stride_om, off_m, col, row_end, N, epi_smem, buf, tma_ok, HM,
             EPI_TMA, store_l)


@gluon.jit
def ws_loader(a_desc, w_desc, a_smem, b_smem, b2_smem, ready, empty, offs_ptr, N, K, E_l, num_progs, N_W, B2_OFF,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_E: gl.constexpr,
               STAGES: gl.constexpr, MODE: gl.constexpr, BLOCK_K: gl.constexpr):
    """Every k-step of this program's tiles, in order, into the ring (stage = step % STAGES), weights as
    [E_l * N_W, K]. MODE 0: one weight tile per stage; 1: two (SwiGLU gate and up, B2_OFF rows apart); 2: two
    adjacent BLOCK_N tiles (a 2 * BLOCK_N-column output tile); 3: "kn" weights viewed as [E_l * K, N_W], k-step ki's
    [BLOCK_K, BLOCK_N] tile at (e * K + ki * BLOCK_K, n0) (K a multiple of BLOCK_K: it stays inside the expert)."""
    TN: gl.constexpr = 2 * BLOCK_N if MODE == 2 else BLOCK_N  # output columns per tile
    sched: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    e_idx, starts, cnts, m_tiles, cum_end, total = schedule(offs_ptr, E_l, N, BLOCK_M, TN, BLOCK_E, sched)
    tiles_n = gl.cdiv(N, TN)
    k_tiles = gl.cdiv(K, BLOCK_K)
    TWO: gl.constexpr = MODE == 1 or MODE == 2  # two weight tiles per stage
    nbytes: gl.constexpr = a_desc.block_type.nbytes + (2 if TWO else 1) * w_desc.block_type.nbytes
    it = 0
    for tile in range(gl.program_id(0), total, num_progs):
        e, row0, row_end, mi, ni = locate(tile, e_idx, starts, cnts, m_tiles, cum_end, tiles_n, GROUP_M)
        off_m = row0 + mi * BLOCK_M
        wrow = e * K if MODE == 3 else e * N_W + ni * TN
        for ki in range(k_tiles):
            s = it % STAGES
            # empty barriers start in phase 0: the first pass over the ring waits for the (complete) phase 1
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, ki * BLOCK_K], ready.index(s), a_smem.index(s))
            if MODE == 3:
                tma.async_copy_global_to_shared(w_desc, [wrow + ki * BLOCK_K, ni * TN], ready.index(s), b_smem.index(s))
            else:
                tma.async_copy_global_to_shared(w_desc, [wrow, ki * BLOCK_K], ready.index(s), b_smem.index(s))
            if TWO:
                tma.async_copy_global_to_shared(w_desc, [wrow + B2_OFF, ki * BLOCK_K], ready.index(s), b2_smem.index(s))
            it += 1
