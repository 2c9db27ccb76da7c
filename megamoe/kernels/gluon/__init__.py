"""Hopper (sm_90a) Gluon kernels, CUDA only: warp-specialised grouped GEMMs (bf16.py, fp8.py), the FP8 SwiGLU backward
(fp8_dswiglu.py), the weight gradient (wgrad.py), the megakernel's items (fused.py); used where their reasons allow."""
