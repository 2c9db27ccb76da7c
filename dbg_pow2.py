import torch
from megamoe.optim import MasterAdamW
from megamoe.kernels.fp8_quant import Fp8Weight, quantize_weight_both, quantize_weight, quantize_weight_ref
dev = "cuda"
def cmp(a, b):
    return int((a.float() != b.float()).sum())
for dtype in (torch.float32, torch.bfloat16):
    for shape in ((2, 64, 40), (2, 64, 48), (2, 128, 40), (2, 64, 128), (3, 200, 136)):
        w = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(dev, dtype)
        R = (*quantize_weight_ref(w), *quantize_weight_ref(w.transpose(1, 2).contiguous()))
        A = quantize_weight_both(w)
        B = (*quantize_weight(w), *quantize_weight(w, transpose=True))
        print("quant", dtype, shape, "both vs ref", [cmp(a, r) for a, r in zip(A, R)], "one vs ref", [cmp(a, r) for a, r in zip(B, R)])
        for cfg in ((32, 32, 8), (16, 32, 16)):
            p = w.clone().requires_grad_()
            opt = MasterAdamW([[p]], lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1)
            opt.fp8_config = cfg
            c = Fp8Weight.empty_like(p)
            opt.maintain_fp8(p, c)
            p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dev, dtype)
            opt.step()
            pd = p.detach()
            R2 = (*quantize_weight_ref(pd), *quantize_weight_ref(pd.transpose(1, 2).contiguous()))
            print("  fused", cfg, "vs ref", [cmp(a, r) for a, r in zip(c.tensors(), R2)])
