"""One layer's KV cache for a batch of sequences, with physical eviction.

Layout: ``k_BHND, v_BHND`` (batch, heads, entries, head dim); ``pos_BHN`` the absolute position of
each entry (RoPE is applied to ``k`` before the write, so a key never moves again); ``live_BHN``
which slots hold an entry. Optional per-entry data: ``g_BHN`` the previous layer's gate of the
entry's token (gated layers only; the value is stored already scaled by ``g`` when the model
injects into values) and ``score_BHN`` the attention the entry has received so far (H2O).

Invariant: the live entries of each ``(b, h)`` row sit at the front, in write order; the tensors
hold ``N = max_bh live count`` slots and every slot past a row's count is zero (``pos = -1``).
With one sequence and a policy that keeps the same count in every head (the gate drops a token
from all heads; the budgeted baselines keep the same number per head) there is no padding at all:
the tensors are exactly the live entries. Eviction builds new, smaller tensors from the kept rows
(``compact``), so a dropped entry's data is gone, the memory shrinks and later steps read fewer
keys.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class LayerCache:
    k_BHND: torch.Tensor
    v_BHND: torch.Tensor
    pos_BHN: torch.Tensor
    live_BHN: torch.Tensor
    g_BHN: torch.Tensor | None = None
    score_BHN: torch.Tensor | None = None
    written: int = 0
    """Entries written per (b, h) row since the start (every row writes one per token)."""

    @classmethod
    def empty(
        cls, B: int, H: int, D: int, *, dtype, device, gated: bool, track_scores: bool
    ) -> LayerCache:
        def z(*shape, dt=dtype):
            return torch.zeros(*shape, dtype=dt, device=device)

        return cls(
            k_BHND=z(B, H, 0, D),
            v_BHND=z(B, H, 0, D),
            pos_BHN=z(B, H, 0, dt=torch.long),
            live_BHN=z(B, H, 0, dt=torch.bool),
            g_BHN=z(B, H, 0, dt=torch.float32) if gated else None,
            score_BHN=z(B, H, 0, dt=torch.float64) if track_scores else None,
        )

    @property
    def n_slots(self) -> int:
        return self.k_BHND.shape[2]

    def live_count_BH(self) -> torch.Tensor:
        return self.live_BHN.sum(-1)

    def append(
        self,
        k_BHTD: torch.Tensor,
        v_BHTD: torch.Tensor,
        pos_T: torch.Tensor,
        g_BHT: torch.Tensor | None,
    ) -> None:
        """Write ``T`` new entries per row after the current slots (``compact`` packs them)."""
        B, H, T, _ = k_BHTD.shape
        if (g_BHT is None) != (self.g_BHN is None):
            raise ValueError("a gated layer's cache needs the gate of every entry, and only it")
        self.k_BHND = torch.cat([self.k_BHND, k_BHTD], dim=2)
        self.v_BHND = torch.cat([self.v_BHND, v_BHTD], dim=2)
        self.pos_BHN = torch.cat([self.pos_BHN, pos_T.expand(B, H, T)], dim=2)
        self.live_BHN = torch.cat([self.live_BHN, self.live_BHN.new_ones(B, H, T)], dim=2)
        if self.g_BHN is not None:
            self.g_BHN = torch.cat([self.g_BHN, g_BHT.to(self.g_BHN.dtype)], dim=2)
        if self.score_BHN is not None:
            self.score_BHN = torch.cat([self.score_BHN, self.score_BHN.new_zeros(B, H, T)], dim=2)
        self.written += T

    def add_scores(self, weights_BHQN: torch.Tensor) -> None:
        """H2O's accumulation: each entry's score grows by the attention every query gave it."""
        if self.score_BHN is not None:
            self.score_BHN = self.score_BHN + weights_BHQN.sum(2).to(self.score_BHN.dtype)

    def compact(self, drop_BHN: torch.Tensor) -> int:
        """Remove the entries marked in ``drop_BHN`` (only live ones count) and repack into new
        tensors of ``max_bh kept count`` slots; returns how many entries went, over all rows."""
        drop_BHN = drop_BHN & self.live_BHN
        n_drop = int(drop_BHN.sum())  # one host sync per layer and step; skips the repack
        if n_drop == 0:
            return 0
        keep_BHN = self.live_BHN & ~drop_BHN
        count_BH = keep_BHN.sum(-1)
        n_keep = int(count_BH.max())
        # Kept slots first, in write order (a stable sort of the "dropped" flags).
        order_BHN = torch.argsort((~keep_BHN).to(torch.int8), dim=-1, stable=True)[..., :n_keep]
        live_BHN = torch.arange(n_keep, device=count_BH.device) < count_BH[..., None]
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and f.name != "live_BHN":
                fill = -1 if f.name == "pos_BHN" else 0
                setattr(self, f.name, _gather_fill_dead(value, order_BHN, live_BHN, fill))
        self.live_BHN = live_BHN
        return n_drop

    def kv_bytes(self) -> int:
        """Bytes the K and V tensors hold now (padding slots included)."""
        return sum(t.numel() * t.element_size() for t in (self.k_BHND, self.v_BHND))


def _gather_fill_dead(
    x: torch.Tensor, order_BHN: torch.Tensor, live_BHN: torch.Tensor, fill: float
) -> torch.Tensor:
    """``x[b, h, order[b, h, n]]`` along dim 2, ``fill`` where the new slot holds no entry
    (``where``, not a product: a dropped row's data never leaks into padding, NaN included)."""
    if x.dim() == 4:
        out = torch.gather(x, 2, order_BHN[..., None].expand(-1, -1, -1, x.shape[-1]))
        return torch.where(live_BHN[..., None], out, fill)
    out = torch.gather(x, 2, order_BHN)
    return torch.where(live_BHN, out, fill)
