"""Byte-level training data from local files. The default corpus is the Python standard library's ``.py`` sources in
sorted order: offline anywhere, the same bytes on every rank and run. Batches come from a generator seeded by (seed,
step, rank), so a resumed run sees exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np
import torch


def default_corpus_files() -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(sysconfig.get_paths()["stdlib"]):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "tests"))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files)


class ByteCorpus:
    """All bytes of ``files`` (default: the stdlib corpus, capped at ``max_bytes``), split train/eval."""

    def __init__(self, files: list[str] | None = None, max_bytes: int = 64 << 20, eval_fraction: float = 0.05):
        self.files = list(files) if files else default_corpus_files()
        if not self.files:
            raise ValueError("no training files found")
        chunks, total = [], 0
        for path in self.files:
            chunks.append(np.fromfile(path, dtype=np.uint8))
            total += len(chunks[-1])
            if total >= max_bytes:
                break
        data = np.concatenate(chunks)[:max_bytes]
        n_eval = max(int(len(data) * eval_fraction), 1)
        self.train = torch.from_numpy(data[:-n_eval].copy())
        self.eval = torch.from_numpy(data[-n_eval:].copy())

    def batch(self, split: str, batch: int, seq: int, seed: int, step: int, rank: int) -> torch.Tensor:
        """int64 [batch, seq + 1] byte windows (inputs are [:, :-1], targets [:, 1:])."""
        src = self.train if split == "train" else self.eval
        if len(src) <= seq + 1:
            raise ValueError(f"the {split} corpus has {len(src)} bytes, too few for sequences of {seq}")
        # a fixed mix of the four numbers (not hash(): str hashing differs between processes)
        key = ((seed * 1_000_003 + step) * 65_537 + rank) * 2 + (split != "train")
        gen = torch.Generator().manual_seed(key & 0x7FFF_FFFF_FFFF_FFFF)
        starts = torch.randint(0, len(src) - seq - 1, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(seq + 1)[None, :]
        return src[idx].long()
