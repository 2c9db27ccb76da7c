"""Hopper (sm_90a) Gluon kernels: warp-specialised grouped GEMMs (bf16.py, fp8.py), the FP8 SwiGLU backward
(fp8_dswiglu.py), the weight-gradient GEMM (wgrad.py) and the megakernel's work items (fused.py). They run on CUDA only;
``megamoe.experts`` and ``megamoe.kernels.fused_moe`` choose them where their reason functions return None."""
