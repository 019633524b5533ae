"""One layer's KV cache in fixed-size pages with a free list (PagedAttention's layout).

Layout: a pool of ``n_pages + 1`` pages, ``k_PSD`` / ``v_PSD`` (pages, page size P, head dim),
and per entry ``pos_PS`` (absolute position, int32), ``kb_PS`` (the gate's key bias
``log(g + 1e-8)``, float32; gated layers that inject into logits) and ``score_PS`` (attention
received so far, H2O). Row (b, h) owns the pages ``table_BHM[b, h, :held_BH[b, h]]``; its
``count_BH[b, h]`` live entries sit in its logical slots 0 .. count - 1, slot n at page
``table[b, h, n // P]``, offset ``n % P`` (what ``kernels/decode_attention.py`` reads). The
values are stored already scaled by the gate when the model injects into values.

Free list: ``free_F[:n_free]`` are the page ids no row holds (a stack; pops from the top). The
last page of the pool (``trash``) is never handed out: writes of rows that must not write (a
finished sequence, a row with no page left) land there, so a decode step keeps static shapes.

Dropping entries never copies the cache: each dropped slot inside the new live range is filled
by one kept entry from past it (``drop``), so a step copies at most as many entries as it drops,
and pages emptied at the end of a row go back on the free list. Slot order is therefore not
write order; ``view`` sorts by position for the research policies, whose ties go to the earlier
entry. ``ensure_page``, ``write_new`` and ``commit`` run on the device with static shapes (a
CUDA graph can hold them; on the Triton path ``append`` runs the three as one kernel,
``kernels/paged_append.py``, of which they are the reference); ``write_prefill``, ``drop`` and
``view`` read counts on the host.
A full pool or a row past its table sets ``overflow`` (checked by the engine at sync points).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stabilitylab.eviction.cache import LayerCache
from stabilitylab.kernels.paged_append import paged_append

STATE = ("table_BHM", "count_BH", "held_BH", "free_F", "n_free", "overflow", "score_PS")
"""What a step changes besides the K/V written past the live range (``snapshot``)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PagedKV:
    k_PSD: torch.Tensor
    v_PSD: torch.Tensor
    pos_PS: torch.Tensor
    kb_PS: torch.Tensor | None
    score_PS: torch.Tensor | None
    table_BHM: torch.Tensor
    count_BH: torch.Tensor
    held_BH: torch.Tensor
    free_F: torch.Tensor
    n_free: torch.Tensor
    overflow: torch.Tensor

    @classmethod
    def allocate(
        cls, B: int, H: int, D: int, *, max_entries: int, page_size: int, dtype, device,
        n_pages: int | None = None, key_bias: bool = False, scores: bool = False,
        score_dtype=torch.float64,
    ) -> PagedKV:  # fmt: skip
        """Room for ``max_entries`` per row in the table; ``n_pages`` in the pool (default: every
        row full, ``B H ceil(max_entries / P)``), plus the trash page."""
        if page_size < 1 or max_entries < 1:
            raise ValueError(f"page_size and max_entries must be >= 1, got {page_size}, {max_entries}")  # fmt: skip
        M = cdiv(max_entries, page_size)
        n_pages = B * H * M if n_pages is None else n_pages
        if n_pages < 1:
            raise ValueError(f"n_pages must be >= 1, got {n_pages}")
        i32 = dict(dtype=torch.int32, device=device)
        pool = (n_pages + 1, page_size)
        kv = cls(
            k_PSD=torch.empty(*pool, D, dtype=dtype, device=device),
            v_PSD=torch.empty(*pool, D, dtype=dtype, device=device),
            pos_PS=torch.full(pool, -1, **i32),
            kb_PS=torch.zeros(pool, dtype=torch.float32, device=device) if key_bias else None,
            score_PS=torch.zeros(pool, dtype=score_dtype, device=device) if scores else None,
            table_BHM=torch.zeros(B, H, M, **i32),
            count_BH=torch.zeros(B, H, **i32),
            held_BH=torch.zeros(B, H, **i32),
            free_F=torch.zeros(n_pages, **i32),
            n_free=torch.zeros(1, **i32),
            overflow=torch.zeros(1, dtype=torch.bool, device=device),
        )
        kv.reset()
        return kv

    # ---- sizes ------------------------------------------------------------------------------

    @property
    def page_size(self) -> int:
        return self.k_PSD.shape[1]

    @property
    def n_pages(self) -> int:
        """Pages rows can hold (the trash page not counted)."""
        return self.free_F.shape[0]

    @property
    def trash_slot(self) -> int:
        return self.n_pages * self.page_size

    def entry_bytes(self) -> int:
        """K and V bytes of one entry."""
        return 2 * self.k_PSD.shape[2] * self.k_PSD.element_size()

    def held_bytes(self, rows: int | None = None) -> int:
        """K/V bytes of the pages the first ``rows`` sequences (all) hold now (a device read)."""
        return int(self.held_BH[:rows].sum()) * self.page_size * self.entry_bytes()

    def pool_bytes(self) -> int:
        """K/V bytes of the whole pool (what was allocated, trash page included)."""
        return (self.n_pages + 1) * self.page_size * self.entry_bytes()

    # ---- state ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Every page free, every row empty; in place (a captured graph keeps its pointers)."""
        self.free_F.copy_(torch.arange(self.n_pages - 1, -1, -1, device=self.free_F.device))
        self.n_free.fill_(self.n_pages)
        for t in (self.table_BHM, self.count_BH, self.held_BH, self.overflow):
            t.zero_()

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n).clone() for n in STATE if getattr(self, n) is not None}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        for name, value in saved.items():
            getattr(self, name).copy_(value)

    def check(self, where: str = "") -> None:
        """Raise if a step ran out of pages (one device read)."""
        if bool(self.overflow.any()):
            raise RuntimeError(
                f"paged KV cache overflow{where}: a row needed a page and the pool ({self.n_pages} "
                "pages) or its block table was full; allocate more pages (n_pages) or max_entries"
            )

    # ---- the static decode path -------------------------------------------------------------

    def ensure_page(self, active_BH: torch.Tensor) -> None:
        """Give each active row whose held pages are full a page from the free list (device)."""
        B, H, M = self.table_BHM.shape
        P = self.page_size
        need_R = (active_BH & (self.count_BH == self.held_BH * P)).flatten()
        need_i = need_R.to(torch.int32)
        rank_R = torch.cumsum(need_i, 0, dtype=torch.int32) - need_i
        take_R = self.n_free - 1 - rank_R
        held_R = self.held_BH.flatten()
        ok_R = need_R & (take_R >= 0) & (held_R < M)
        page_R = self.free_F[take_R.clamp(0, self.n_pages - 1).long()]
        col_BH1 = held_R.clamp(max=M - 1).view(B, H, 1).long()
        old_BH1 = self.table_BHM.gather(2, col_BH1)
        self.table_BHM.scatter_(2, col_BH1, torch.where(ok_R.view(B, H, 1), page_R.view(B, H, 1), old_BH1))  # fmt: skip
        self.held_BH += ok_R.view(B, H).to(torch.int32)
        self.n_free -= need_i.sum()
        self.overflow |= (need_R & ~ok_R).any()

    def slot_of_next_BH(self, active_BH: torch.Tensor) -> torch.Tensor:
        """Flat pool slot of each row's logical slot ``count`` (trash for rows that must not
        write: inactive, or no page there)."""
        M, P = self.table_BHM.shape[2], self.page_size
        col_BH1 = (self.count_BH // P).clamp(max=M - 1)[..., None].long()
        page_BH = self.table_BHM.gather(2, col_BH1)[..., 0].long()
        ok_BH = active_BH & (self.count_BH < self.held_BH * P)
        flat_BH = page_BH * P + (self.count_BH % P).long()
        return torch.where(ok_BH, flat_BH, self.trash_slot)

    def write_new(self, k_BHD, v_BHD, kb_BH, pos_B, active_BH) -> None:
        """Write one entry per active row at its logical slot ``count`` (not yet live:
        ``commit`` counts it); the score starts at 0."""
        B, H, D = k_BHD.shape
        flat_R = self.slot_of_next_BH(active_BH).flatten()
        self.k_PSD.view(-1, D).index_copy_(0, flat_R, k_BHD.reshape(B * H, D))
        self.v_PSD.view(-1, D).index_copy_(0, flat_R, v_BHD.reshape(B * H, D))
        pos_R = pos_B[:, None].expand(B, H).reshape(-1).to(torch.int32)
        self.pos_PS.view(-1).index_copy_(0, flat_R, pos_R)
        if self.kb_PS is not None:
            self.kb_PS.view(-1).index_copy_(0, flat_R, kb_BH.reshape(-1).to(torch.float32))
        if self.score_PS is not None:
            self.score_PS.view(-1).index_fill_(0, flat_R, 0)

    def append(self, k_BHD, v_BHD, kb_BH, pos_B, active_BH, fused: bool) -> None:
        """``ensure_page``, ``write_new``, ``commit(active_BH)``: one decode step's entries
        written and counted live. ``fused``: in one launch of ``kernels/paged_append.py`` (the
        same buffers after, bit for bit); else these three methods (the reference)."""
        if fused:
            paged_append(self, k_BHD, v_BHD, kb_BH, pos_B, active_BH)
            return
        self.ensure_page(active_BH)
        self.write_new(k_BHD, v_BHD, kb_BH, pos_B, active_BH)
        self.commit(active_BH)

    def commit(self, add_BH: torch.Tensor) -> None:
        """``count += add`` (bool or int per row): the written entries become live, or not."""
        self.count_BH += add_BH.to(torch.int32)

    # ---- the eager paths --------------------------------------------------------------------

    def flat_slots(self, b, h, n) -> torch.Tensor:
        """Flat pool slots of logical slots ``n`` of rows ``(b, h)`` (index tensors)."""
        P = self.page_size
        return self.table_BHM[b, h, n // P].long() * P + n % P

    def write_prefill(self, k_BHTD, v_BHTD, kb_BHT, keep_BHT, score_BHT=None) -> None:
        """After ``reset``: the kept entries of a prefill (token t at position t), packed in
        position order, each row on fresh pages."""
        B, H, T, D = k_BHTD.shape
        M, P = self.table_BHM.shape[2], self.page_size
        count_BH = keep_BHT.sum(-1).to(torch.int32)
        pages_BH = (count_BH + P - 1) // P
        total, n_free = int(pages_BH.sum()), int(self.n_free)
        if total > n_free or int(pages_BH.max()) > M:
            raise ValueError(
                f"the prefill needs {total} pages (at most {int(pages_BH.max())} per row); the "
                f"pool has {n_free} free and rows hold at most {M}"
            )
        ids_F = self.free_F[n_free - total : n_free].flip(0)
        start_BH = torch.cumsum(pages_BH.flatten(), 0).view(B, H) - pages_BH
        taken_BHM = torch.arange(M, device=k_BHTD.device) < pages_BH[..., None]
        self.table_BHM[taken_BHM] = ids_F[(start_BH[..., None] + torch.arange(M, device=k_BHTD.device))[taken_BHM]]  # fmt: skip
        self.held_BH.copy_(pages_BH)
        self.n_free -= total
        b, h, t = keep_BHT.nonzero(as_tuple=True)
        n = (torch.cumsum(keep_BHT.to(torch.int64), -1) - 1)[b, h, t]
        flat = self.flat_slots(b, h, n)
        self.k_PSD.view(-1, D)[flat] = k_BHTD[b, h, t]
        self.v_PSD.view(-1, D)[flat] = v_BHTD[b, h, t]
        self.pos_PS.view(-1)[flat] = t.to(torch.int32)
        if self.kb_PS is not None:
            self.kb_PS.view(-1)[flat] = kb_BHT[b, h, t].to(torch.float32)
        if self.score_PS is not None:
            self.score_PS.view(-1)[flat] = score_BHT[b, h, t].to(self.score_PS.dtype)
        self.count_BH.copy_(count_BH)

    def drop(self, drop_BHN: torch.Tensor) -> int:
        """Remove the live entries marked in ``drop_BHN`` (logical slots of each row, N >= the
        largest count): each hole below the new count takes one kept entry from past it; pages
        past the new count go back on the free list. Returns how many entries went."""
        N = drop_BHN.shape[-1]
        n_N = torch.arange(N, device=drop_BHN.device)
        live_BHN = n_N < self.count_BH[..., None]
        drop_BHN = drop_BHN & live_BHN
        new_BH = self.count_BH - drop_BHN.sum(-1).to(torch.int32)
        hole_BHN = drop_BHN & (n_N < new_BH[..., None])
        mover_BHN = live_BHN & ~drop_BHN & (n_N >= new_BH[..., None])
        # Row-major nonzero order pairs the k-th hole of a row with its k-th mover.
        dst = self.flat_slots(*hole_BHN.nonzero(as_tuple=True))
        src = self.flat_slots(*mover_BHN.nonzero(as_tuple=True))
        for f in ("k_PSD", "v_PSD", "pos_PS", "kb_PS", "score_PS"):
            buf = getattr(self, f)
            if buf is not None:
                flat = buf.view(-1, buf.shape[-1]) if buf.dim() == 3 else buf.view(-1)
                flat[dst] = flat[src]
        n_drop = int(drop_BHN.sum())
        self.count_BH.copy_(new_BH)
        self.free_pages_past_count()
        return n_drop

    def free_pages_past_count(self) -> None:
        """Pages a row holds past ``ceil(count / P)`` go back on the free list."""
        P, M = self.page_size, self.table_BHM.shape[2]
        need_BH = (self.count_BH + P - 1) // P
        m_M = torch.arange(M, device=need_BH.device)
        spare_BHM = (m_M >= need_BH[..., None]) & (m_M < self.held_BH[..., None])
        ids = self.table_BHM[spare_BHM]
        n_free, k = int(self.n_free), ids.numel()
        self.free_F[n_free : n_free + k] = ids
        self.n_free += k
        self.held_BH.copy_(torch.minimum(self.held_BH, need_BH))

    # ---- views for the research policies ----------------------------------------------------

    def view(self, with_keys: bool) -> tuple[LayerCache, torch.Tensor]:
        """``(cache, order_BHN)``: the live entries as a research ``LayerCache`` (live first, in
        position order; N = the largest count), and each view slot's logical slot. Keys only
        ``with_keys`` (KeyDiff); values never (no policy reads them)."""
        B, H, _ = self.table_BHM.shape
        n_N = torch.arange(max(int(self.count_BH.max()), 1), device=self.count_BH.device)
        b_BHN = torch.arange(B, device=n_N.device)[:, None, None].expand(B, H, n_N.numel())
        h_BHN = torch.arange(H, device=n_N.device)[None, :, None].expand_as(b_BHN)
        flat_BHN = self.flat_slots(b_BHN, h_BHN, n_N.expand_as(b_BHN))
        live_BHN = n_N < self.count_BH[..., None]
        pos_BHN = torch.where(live_BHN, self.pos_PS.view(-1)[flat_BHN].long(), -1)
        big = torch.iinfo(torch.int64).max
        order_BHN = torch.argsort(torch.where(live_BHN, pos_BHN, big), dim=-1, stable=True)
        flat_BHN = flat_BHN.gather(-1, order_BHN)
        live_BHN = live_BHN.gather(-1, order_BHN)
        D = self.k_PSD.shape[2]
        if with_keys:
            k_BHND = self.k_PSD.view(-1, D)[flat_BHN]
        else:  # shape only: a policy that reads no key takes B from it
            k_BHND = self.k_PSD.new_zeros(()).expand(B, H, n_N.numel(), D)
        score = None if self.score_PS is None else self.score_PS.view(-1)[flat_BHN]
        cache = LayerCache(
            k_BHND=k_BHND, v_BHND=k_BHND, pos_BHN=pos_BHN.gather(-1, order_BHN),
            live_BHN=live_BHN, g_BHN=None, score_BHN=score,
        )  # fmt: skip
        return cache, order_BHN

    def live_positions(self) -> list[list[list[int]]]:
        """Each row's live positions, sorted (tests compare live sets with the research loop)."""
        cache, _ = self.view(with_keys=False)
        pos, live = cache.pos_BHN.tolist(), cache.live_BHN.tolist()
        return [
            [sorted(p for p, ok in zip(pr, lr, strict=True) if ok) for pr, lr in zip(pb, lb, strict=True)]
            for pb, lb in zip(pos, live, strict=True)
        ]  # fmt: skip


def logical_drop_BHN(drop_view_BHN: torch.Tensor, order_BHN: torch.Tensor) -> torch.Tensor:
    """A drop mask over a ``view``'s slots mapped back to the rows' logical slots."""
    out_BHN = torch.zeros_like(drop_view_BHN)
    return out_BHN.scatter_(-1, order_BHN, drop_view_BHN)


__all__ = ["PagedKV", "logical_drop_BHN"]
