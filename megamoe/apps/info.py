"""``megamoe info``: versions, GPUs, the peer-access matrix, and whether torch symmetric memory works here."""

from __future__ import annotations

import argparse
import platform


def _symm_mem_probe(rank: int, world: int) -> str:
    """On each GPU rank: allocate symmetric memory, rendezvous, write my rank, read every peer's value."""
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    t = symm_mem.empty(4, dtype=torch.int32, device=torch.device("cuda", rank))
    handle = symm_mem.rendezvous(t, dist.group.WORLD.group_name)
    t.fill_(rank + 1)
    torch.cuda.synchronize()
    dist.barrier()
    seen = [int(handle.get_buffer(peer, (4,), torch.int32)[0].item()) for peer in range(world)]
    dist.barrier()
    expected = [p + 1 for p in range(world)]
    return "ok" if seen == expected else f"wrong values: read {seen}, expected {expected}"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="megamoe info", description=__doc__).parse_args(argv)
    import numpy
    import torch
    import triton

    import megamoe
    from megamoe.backends import available_backends, why_unavailable
    from megamoe.dist import spawn

    print(f"megamoe {megamoe.__version__}  python {platform.python_version()}  torch {torch.__version__}  "
          f"triton {triton.__version__}  numpy {numpy.__version__}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cuda" if n else "cpu"
    if n == 0:
        print("GPUs: none (CPU only: the layer runs on gloo ranks, Triton kernels under TRITON_INTERPRET=1, "
              "the symmetric heap in host shared memory)")
    else:
        print(f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {n} GPU(s):")
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            print(f"  cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                  f"{p.total_memory / 2**30:.0f} GiB")
        print("peer access (row can access column):")
        print("        " + " ".join(f"{j:>3}" for j in range(n)))
        for i in range(n):
            row = ["  -" if i == j else ("yes" if torch.cuda.can_device_access_peer(i, j) else " no") for j in range(n)]
            print(f"  cuda:{i} " + " ".join(row))
        try:
            results = spawn(_symm_mem_probe, n, device="cuda", timeout_s=300)
            bad = [f"rank {r}: {s}" for r, s in enumerate(results) if s != "ok"]
            print("symmetric memory: " + ("works on all " + str(n) + " GPUs" if not bad else "; ".join(bad)))
        except Exception as exc:  # noqa: BLE001 - report, do not crash the info command
            print(f"symmetric memory: FAILED ({str(exc).splitlines()[0]})")
    print("backends: " + ", ".join(
        f"{b} ({'available' if b in available_backends(device) else why_unavailable(b, device)})"
        for b in ("torch", "split", "fused")))
    return 0
