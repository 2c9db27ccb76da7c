"""The warp-specialised Gluon weight-gradient kernel (megamoe/kernels/gluon_wgrad_ws.py), forced through
GemmConfig(kernel="gluon_ws") on megamoe.experts.grouped_wgrad, on an H100/H200: against the float64 twin (whole and
per expert) and the Triton wgrad kernel on the same inputs. Padding rows of both operands hold NaN (after the last
group), so a read of one as data fails; rows of other experts inside a partial chunk's window must contribute exact
zeros. Edge cases: empty, 1-row, 5-row first group (its window starts before row 0: TMA zero fill), 63 / 64 / 65 /
127 / 129-row groups, one group holding every row, M a multiple of 64 but not of 128 (the second consumer's half of
the last m-tile skipped), N not a multiple of the tile (clipped), bf16 and float32 outputs, BLOCK_K 32 and 64, 2
stages, 3 persistent programs (the ring carries across tiles of different experts), bitwise repeatability.

    pytest -q -m gpu tests/test_gpu_gluon_wgrad.py          (on the H200)
"""

from __future__ import annotations

import pytest
import torch
from gemm_cases import problem, rel

pytestmark = pytest.mark.gpu
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma)")

GROUPS = [[5, 0, 1, 127, 129, 64, 63, 65, 700], [3000], [300, 0, 77], [0, 0]]
#: (block_n, block_k, stages at most, programs)
CFGS = [(256, 64, 3, None), (256, 64, 2, 3), (128, 64, 5, None), (256, 32, 6, 3), (128, 32, 3, None)]


def _cfg(block_n, block_k, stages, num_sms, out_dtype=torch.bfloat16):
    """The config with at most ``stages`` stages: fewer where the output dtype's staging buffers leave less room."""
    from megamoe.kernels.gemm_config import GemmConfig
    from megamoe.kernels.gluon_wgrad_ws import ws_wgrad_limits

    cfg = GemmConfig(block_m=128, block_n=block_n, block_k=block_k, num_stages=stages, num_warps=4, num_sms=num_sms,
                     kernel="gluon_ws")
    while ws_wgrad_limits(cfg, m=64, n=64, out_dtype=out_dtype) is not None and cfg.num_stages > 2:
        cfg = cfg.with_(num_stages=cfg.num_stages - 1)
    return cfg


def _operands(sizes, M, N, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    E_l, used, R, offs = problem(sizes)
    x = torch.randn(R, M, device="cuda", generator=gen).to(torch.bfloat16)
    y = torch.randn(R, N, device="cuda", generator=gen).to(torch.bfloat16)
    x[used:] = float("nan")
    y[used:] = float("nan")
    return E_l, used, offs, x, y


@needs_hopper
@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("cfg", CFGS, ids=[f"bn{c[0]}-bk{c[1]}-s{c[2]}-p{c[3]}" for c in CFGS])
@pytest.mark.parametrize("M,N", [(256, 512), (192, 200), (64, 72)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_ws_wgrad(sizes, cfg, M, N, out_dtype):
    import megamoe.experts as X
    from megamoe.kernels.gemm_config import LAST_COMPILED, GemmConfig

    E_l, used, offs, x, y = _operands(sizes, M, N, seed=M + N)
    LAST_COMPILED.pop("_gluon_wgrad_ws_kernel", None)
    got = X.grouped_wgrad(x, y, offs, out_dtype=out_dtype, config=_cfg(*cfg, out_dtype))
    assert "_gluon_wgrad_ws_kernel" in LAST_COMPILED
    again = X.grouped_wgrad(x, y, offs, out_dtype=out_dtype, config=_cfg(*cfg, out_dtype))
    tri = X.grouped_wgrad(x, y, offs, out_dtype=out_dtype,
                          config=GemmConfig(block_m=128, block_n=256, block_k=32, num_stages=5, num_warps=8,
                                            flatten=True, kernel="triton"))
    ref = X.grouped_wgrad_ref(x[:used].double(), y[:used].double(), offs)
    torch.cuda.synchronize()
    assert got.dtype == out_dtype and tuple(got.shape) == (E_l, M, N)
    assert torch.equal(got, again), "two runs differ bitwise"
    assert bool(torch.isfinite(got).all()), "NaN / inf in the gradient: padding or another expert's rows leaked"
    sizes_t = torch.tensor(sizes)
    for e in range(E_l):  # empty experts: exact zeros; the others against float64 and the Triton kernel
        if sizes_t[e] == 0:
            assert bool((got[e] == 0).all()), f"expert {e} (no rows) not zero"
            continue
        assert rel(got[e].double(), ref[e]) < 1e-2, f"expert {e} vs float64"
        assert rel(got[e].float(), tri[e].float()) < 2e-3, f"expert {e} vs the Triton wgrad kernel"


@needs_hopper
def test_ws_wgrad_deepseek_shape():
    """dW13-like shape at deepseek width (M = 2I = 4096, N = H = 7168) with uneven groups, default-like config."""
    import megamoe.experts as X

    sizes = [288, 736, 511, 513, 0, 1, 640, 257]
    E_l, used, offs, x, y = _operands(sizes, 4096, 7168, seed=3)
    got = X.grouped_wgrad(x, y, offs, out_dtype=torch.bfloat16, config=_cfg(256, 64, 3, None))
    ref = X.grouped_wgrad_ref(x[:used].double(), y[:used].double(), offs)
    torch.cuda.synchronize()
    for e in range(E_l):
        assert rel(got[e].double(), ref[e]) < 1e-2 if sizes[e] else bool((got[e] == 0).all()), f"expert {e}"


@needs_hopper
def test_ws_wgrad_limits():
    import megamoe.experts as X
    from megamoe.kernels.gemm_config import GemmConfig

    E_l, used, offs, x, y = _operands([10, 20], 96, 64, seed=0)  # M % 64 != 0
    with pytest.raises(ValueError, match="multiple of 64"):
        X.grouped_wgrad(x, y, offs, out_dtype=torch.bfloat16, config=_cfg(256, 64, 3, None))
    E_l, used, offs, x, y = _operands([10, 20], 128, 64, seed=0)
    big = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=4, num_warps=4, kernel="gluon_ws")
    with pytest.raises(ValueError, match="shared memory"):
        X.grouped_wgrad(x, y, offs, out_dtype=torch.bfloat16, config=big)
