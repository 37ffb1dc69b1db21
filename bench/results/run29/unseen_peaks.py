"""Peaks of two models the bench has no variant for (bench/RESULTS.md run29), fsdpfn (functional,
``min_bucket_bytes="auto"``; compat) against torch's ``fully_shard``, same MemTracker accounting: 6
``nn.TransformerEncoderLayer`` blocks (pre-norm, width 192) with an embedding and an LM head; a 1-D ConvNet
with grouped convolutions and GroupNorm.

    PYTHONPATH=bench/results/run29 python bench/results/run29/unseen_peaks.py
"""
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self, vocab=2000, d=192, n=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True) for _ in range(n)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))
class Conv1(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Conv1d(64, 64, 5, padding=2, groups=4), nn.GroupNorm(8, 64), nn.SiLU(), nn.Conv1d(64, 64, 1)) for _ in range(8)])
        self.inp = nn.Conv1d(3, 64, 3, padding=1); self.out = nn.Linear(64, 7)
    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks: h = h + b(h)
        return self.out(h.mean(-1))
def run(kind):
    import fsdpfn, fsdpfn.compat
    from fsdpfn.testing.memory import measured_fsdp2_step_peak, measured_step_peak
    torch.manual_seed(0)
    build, x, n = (Net, torch.randint(0, 2000, (8, 32)), 6) if kind == "tel" else (Conv1, torch.randn(16, 3, 100), 8)
    units = [f"blocks.{i}" for i in range(n)]
    ours = measured_step_peak(build(), x, units=units, min_bucket_bytes="auto")
    theirs = measured_fsdp2_step_peak(build(), x, units=units)
    compat = measured_fsdp2_step_peak(build(), x, units=units, fully_shard=fsdpfn.compat.fully_shard)
    return ours.peak, theirs, compat, ours.groups
if __name__ == "__main__":
    import warnings; warnings.filterwarnings("ignore")
    from fsdpfn.testing import spmd
    from unseen_peaks import run as r
    for kind in ("tel", "conv1"):
        for world in (2, 3):
            for rank, (o, t, c, g) in enumerate(spmd(world, r, kind)):
                print(f"{kind} world {world} rank {rank}: functional {o / t:.5f} ({o - t:+d} B), compat {c / t:.5f} ({c - t:+d} B) of torch's {t / 2**20:.2f} MiB; groups {g}")
