"""A delta-rule piece as a zero-state run plus a correction: the sub-piece plan and the float64 reference.

The gated delta rule (fla's ``chunk_gated_delta_rule``: a log decay ``g`` per head and token) and KDA (fla's
``chunk_kda``: a log decay per head, token and key channel) share fla's chunk form. One piece of a sequence
(a segment, or its part on one context-parallel rank) is entered by a state ``S_in [K, V]`` per head that
the scan delivers late. fla's forward run from a ZERO entering state gives the output ``o^0`` and the
leaving state ``E``; everything ``S_in`` adds is linear in it and is computed here, in fla's conventions
(state ``h [K, V]``, chunks of BT tokens; ``*`` the product per key channel, a scalar gate acting on
every channel alike):

    G        the log decay summed inside the chunk up to and including each token (fla's
             ``chunk_local_cumsum(g)``; natural log, or base 2 as fla stores it, ``g_log2=True``):
             ``[B, T, H]`` (the gated delta rule) or ``[B, T, H, K]`` (KDA)
    w        ``(I + L)^-1 (beta exp(G) * k)`` per chunk (fla's ``chunk_gated_delta_rule_fwd_intra``,
             ``chunk_kda_fwd_intra``), ``L_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)`` (j < i)
    Aqk      ``scale tril_incl(sum_c q_ic k_jc exp(G_ic - G_jc))`` per chunk ([BT, BT]; fla's KDA
             forward returns it, its gated-delta-rule output kernel forms it in place)
    per chunk c entered by h_c:
             v_new_c = u_c - w_c h_c,   h_{c+1} = Diag(exp(G_last)) h_c + (k_c * exp(G_last - G))^T v_new_c
             o_c     = scale (q_c * exp(G)) h_c + Aqk_c v_new_c

so the chunk maps the state by ``T_c = Diag(exp(G_last)) - (k_c * exp(G_last - G))^T w_c`` (K x K) and the
outputs read it through ``Qt_c = scale (q_c * exp(G)) - Aqk_c w_c`` ([BT, K]):

    h_{c+1} = T_c h_c + (...),        o_c = o^0_c + Qt_c M_{<c} S_in,     M_{<c} = T_{c-1} ... T_0.

A piece's chunks are cut into sub-pieces (runs of whole chunks, never straddling a segment), so the
sequential work runs on many programs at once:

    K1 reads     Qt_c for every chunk                                                (parallel over chunks)
    K2 maps      per sub-piece j, from the identity: R_c = Qt_c M, M <- T_c M; L_j = M at its end
                 (so R_c = Qt_c (T_{c-1} ... T_{first of j}), [BT, K] per head)       (sequential in j)
    K3 prefix    P_j = L_{j-1} ... L_0 (P_0 = I); the segment's M = P_S               (sequential over j)
    K4 output    o_c = o^0_c + R_c X_j,  X_j = P_j S_in                                (parallel; after the scan)
    K5 gradient  A = sum_j P_j^T (sum_{c in j} R_c^T do_c)                             (parallel reduction)

Only K1 and K2 read the gate. ``S_out = M S_in + E`` (``M`` as the operators' ``chunk_*_state``: latest
token leftmost, acting on the K rows of the state), and the entering state's gradient from the piece's
outputs is ``A``; the backward scan adds ``M^T D`` (D: the leaving state's gradient). The gradients of
the inputs are fla's backward from ``initial_state=S_in`` with ``dht=D``: the piece computes
``o = f(x, S_in)``, ``S_out = F(x, S_in)``, and nothing here changes f or F.

Heads: q and k may have fewer heads than the rest (fla's grouped value attention: value head h reads
query/key head ``h // (H // HQ)``); w, G, Aqk, Qt, R and the states are per value head.

Packed input: ``cu_seqlens`` offsets of N segments in one row (B = 1); every segment has its own
``S_in``, ``M``, ``A`` and chunks (fla's varlen chunking: chunks restart at each segment's start, the
last one may be partial, a segment may be shorter than a chunk). Dense input ``[B, T, ...]`` is B
segments of T tokens (:meth:`SubPieces.dense`). :class:`SubPieces` is the host-side plan shared with the
Triton kernels (``megatron_zeco.kernels.delta_correction``); this module is their reference (the tests';
the CPU runs the operators' chunked forms) and imports no Triton. Every function computes in float64
for float64 inputs and in float32 otherwise, and takes the keyword arguments of its kernel counterpart
(dtype and precision choices of the GPU path are accepted and only the output dtypes honoured). Pair
decays are formed per pair and channel, ``exp(G_i - G_j)`` with ``j <= i`` (never ``exp(G_i) exp(-G_j)``),
so strong decay neither overflows nor cancels.
"""

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

Tensor = torch.Tensor
RCP_LN2 = 1.4426950408889634  # 1 / ln 2: fla keeps G in base 2


class SubPieces:
    """Where the chunks and sub-pieces of a (packed) piece lie: the host plan of every launch.

    Args:
        cu_seqlens: ``[N+1]`` nondecreasing token offsets from 0 (a host tensor or sequence: the plan is
            built on the host and never reads a device).
        chunk_size: BT, tokens per chunk (chunks restart at every segment's start).
        sub_pieces: sub-pieces per segment, one int for all or one per segment (see
            :func:`choose_sub_pieces`); each at least 1 and clamped to the segment's chunk count (an empty
            segment has none). A segment of ``n`` chunks cut into ``s`` sub-pieces gets runs of
            ``ceil(n / s)`` chunks first and ``floor(n / s)`` after.

    Attributes (host Python ints):
        segments: ``(bos, eos)`` token rows of each segment.
        pieces: ``(segment, first chunk in the segment, chunk count)`` of each sub-piece, segment-major.
        piece_offsets: ``[N+1]``: segment n owns sub-pieces ``piece_offsets[n] .. piece_offsets[n+1]-1``.
        chunks: ``(segment, chunk in the segment, sub-piece)`` of each chunk, segment-major (fla's
            ``chunk_indices`` order).

    :meth:`runs` cuts the sub-pieces further into runs of a few chunks, the programs of the parallel
    kernels K4 and K5 (each reads its sub-piece's ``[K, V]`` block once per run).
    """

    def __init__(self, cu_seqlens: Union[Tensor, Sequence[int]], chunk_size: int,
                 sub_pieces: Union[int, Sequence[int]] = 1):
        if isinstance(cu_seqlens, Tensor):
            if cu_seqlens.device.type != "cpu":
                raise ValueError("SubPieces is built from the host copy of cu_seqlens (no device sync)")
            cu_seqlens = cu_seqlens.tolist()
        cu = [int(x) for x in cu_seqlens]
        if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must be nondecreasing offsets from 0, got {cu}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        N = len(cu) - 1
        counts = [sub_pieces] * N if isinstance(sub_pieces, int) else [int(s) for s in sub_pieces]
        if len(counts) != N or any(s < 1 for s in counts):
            raise ValueError(f"sub_pieces must be one positive int or one per segment ({N}), got {sub_pieces}")
        self.chunk_size, self.cu_seqlens = chunk_size, tuple(cu)
        self.segments = tuple(zip(cu[:-1], cu[1:]))
        pieces, chunks, offsets = [], [], [0]
        for n, (bos, eos) in enumerate(self.segments):
            nt = -(-(eos - bos) // chunk_size)
            s = min(counts[n], nt)
            first = 0
            for i in range(s):
                size = nt // s + (i < nt % s)
                chunks.extend((n, first + c, len(pieces)) for c in range(size))
                pieces.append((n, first, size))
                first += size
            offsets.append(len(pieces))
        self.pieces, self.chunks, self.piece_offsets = tuple(pieces), tuple(chunks), tuple(offsets)
        self._tables: Dict[Tuple[torch.device, int], Dict[str, Tensor]] = {}

    @classmethod
    def dense(cls, batch: int, length: int, chunk_size: int, sub_pieces: Union[int, Sequence[int]] = 1):
        """The plan of ``batch`` sequences of ``length`` tokens (``[B, T, ...]`` inputs)."""
        return cls([b * length for b in range(batch + 1)], chunk_size, sub_pieces)

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def num_pieces(self) -> int:
        return len(self.pieces)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def tokens(self) -> int:
        return self.cu_seqlens[-1]

    def counts(self) -> List[int]:
        """Sub-pieces of each segment (after clamping)."""
        return [b - a for a, b in zip(self.piece_offsets, self.piece_offsets[1:])]

    def chunk_bounds(self, segment: int, chunk: int) -> Tuple[int, int]:
        """Token rows ``[start, end)`` of a chunk."""
        bos, eos = self.segments[segment]
        start = bos + chunk * self.chunk_size
        return start, min(start + self.chunk_size, eos)

    def runs(self, chunks: int) -> Tuple[Tuple[Tuple[int, int, int, int], ...], Tuple[int, ...]]:
        """Each sub-piece cut into runs of ``chunks`` chunks (its last run shorter): ``(segment, first chunk
        in the segment, chunk count, sub-piece)`` of each run, segment-major and in order, and ``[N+1]``
        offsets (segment n owns runs ``offsets[n] .. offsets[n+1]-1``). ``chunks`` at least a sub-piece's
        length gives one run per sub-piece."""
        if chunks < 1:
            raise ValueError(f"chunks per run must be positive, got {chunks}")
        runs, offsets = [], [0]
        for n in range(self.num_segments):
            for j in range(self.piece_offsets[n], self.piece_offsets[n + 1]):
                _, first, count = self.pieces[j]
                runs.extend((n, c, min(chunks, first + count - c), j) for c in range(first, first + count, chunks))
            offsets.append(len(runs))
        return tuple(runs), tuple(offsets)

    def tables(self, device: Union[str, torch.device], chunks_per_run: int = 0) -> Dict[str, Tensor]:
        """The kernels' launch tables on ``device`` (int32; copied once per device and kept):

        ``chunks [NC, 4]``: (bos, eos of the segment, chunk in the segment, sub-piece) per chunk;
        ``pieces [NS, 5]``: (segment, bos, eos, first chunk, chunk count) per sub-piece;
        ``piece_offsets [N+1]``; with ``chunks_per_run`` > 0 instead, the :meth:`runs` of that length:
        ``runs [NR, 5]``: (bos, eos of the segment, first chunk, chunk count, sub-piece) per run, and
        ``run_offsets [N+1]``. Built from host data; the copies are asynchronous (pinned memory)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if (device, chunks_per_run) not in self._tables:
            if chunks_per_run:
                runs, offsets = self.runs(chunks_per_run)
                host = {"runs": ([(*self.segments[n], c0, nc, j) for n, c0, nc, j in runs], 5),
                        "run_offsets": (list(offsets), None)}
            else:
                host = {
                    "chunks": ([(*self.segments[n], c, j) for n, c, j in self.chunks], 4),
                    "pieces": ([(n, *self.segments[n], c0, nc) for n, c0, nc in self.pieces], 5),
                    "piece_offsets": (list(self.piece_offsets), None),
                }
            out = {}
            for name, (rows, width) in host.items():
                t = torch.tensor(rows, dtype=torch.int32)
                if width is not None:
                    t = t.view(-1, width)
                if device.type == "cuda":
                    t = t.pin_memory().to(device, non_blocking=True)
                out[name] = t.to(device)
            self._tables[(device, chunks_per_run)] = out
        return self._tables[(device, chunks_per_run)]

    def __repr__(self) -> str:
        return (f"SubPieces(segments={self.num_segments}, chunks={self.num_chunks}, sub_pieces={self.counts()}, "
                f"chunk_size={self.chunk_size})")


def choose_sub_pieces(cu_seqlens: Union[Tensor, Sequence[int]], chunk_size: int, heads: int, column_blocks: int,
                      processors: int, waves: float = 2.0, min_chunks: int = 4) -> List[int]:
    """Sub-pieces per segment so that the sequential kernel (K2, ``sub-pieces x heads x column_blocks``
    programs, each walking its run of chunks) fills ``waves`` times ``processors`` (SMs) and no more: a
    partly filled extra wave would take as long as a full one. Runs of at least ``min_chunks`` chunks
    (shorter runs cost more in K3..K5 than they win): one common run length over all segments."""
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    nt = [-(-(b - a) // chunk_size) for a, b in zip(cu, cu[1:])]
    wanted = max(1, math.floor(waves * processors / max(1, heads * column_blocks)))
    run = max(min_chunks, math.ceil(sum(nt) / wanted), 1)
    return [max(1, -(-n // run)) for n in nt]


def _dtype(*xs: Optional[Tensor]) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def _rows(x: Tensor, plan: SubPieces) -> Tensor:
    """``[B, T, H, D]`` (or ``[B, T, H]``) -> token rows ``[B*T, H, ...]`` of the plan."""
    if x.shape[0] * x.shape[1] != plan.tokens:
        raise ValueError(f"{tuple(x.shape)} holds {x.shape[0] * x.shape[1]} tokens, the plan {plan.tokens}")
    return x.reshape(plan.tokens, *x.shape[2:])


def _exp(x: Tensor, log2: bool) -> Tensor:
    return torch.exp2(x) if log2 else torch.exp(x)


def _gate_rows(g: Tensor, plan: SubPieces, dt: torch.dtype) -> Tensor:
    """G as token rows ``[tokens, H, 1]`` (a gate per head) or ``[tokens, H, K]`` (per key channel)."""
    G = _rows(g, plan).to(dt)
    return G.unsqueeze(-1) if G.dim() == 2 else G


def _value_heads(x: Tensor, heads: int) -> Tensor:
    """Query/key rows ``[tokens, HQ, K]`` -> ``[tokens, H, K]`` (value head h reads head ``h // (H // HQ)``)."""
    if heads % x.shape[1]:
        raise ValueError(f"{heads} value heads are not a multiple of {x.shape[1]} query/key heads")
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _pair_decays(Gc: Tensor, log2: bool, strict: bool) -> Tensor:
    """``exp(G_i - G_j)`` per head, pair and channel ``[H, C, C, K or 1]`` for ``j <= i`` (``j < i`` if
    ``strict``), zero elsewhere; ``Gc [C, H, K or 1]`` one chunk's G."""
    C = Gc.shape[0]
    keep = torch.ones(C, C, dtype=torch.bool, device=Gc.device).tril(-1 if strict else 0)
    G = Gc.transpose(0, 1)  # [H, C, Kg]
    diff = G[:, :, None, :] - G[:, None, :, :]
    return _exp(torch.where(keep[None, :, :, None], diff, -math.inf), log2)


def chunk_local_cumsum(g: Tensor, plan: SubPieces, log2: bool = False) -> Tensor:
    """G: ``g [B, T, H]`` or ``[B, T, H, K]`` summed inside each chunk up to and including each token (times
    1/ln 2 when ``log2``, fla's convention), in the compute dtype."""
    dt = _dtype(g)
    gr, out = _rows(g, plan).to(dt), torch.zeros(plan.tokens, *g.shape[2:], dtype=dt, device=g.device)
    for n, c, _ in plan.chunks:
        s, e = plan.chunk_bounds(n, c)
        out[s:e] = gr[s:e].cumsum(0)
    return (out * RCP_LN2 if log2 else out).view(g.shape)


def wy_representation(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, plan: SubPieces) -> Tuple[Tensor, Tensor]:
    """fla's WY transform per chunk from raw log decays ``g [B, T, H]`` or ``[B, T, H, K]`` (natural log):
    ``w = (I + L)^-1 (beta exp(G) * k)`` ``[B, T, H, K]`` and ``u = (I + L)^-1 (beta v)`` ``[B, T, H, V]``,
    ``L_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)`` for ``j < i`` (compute dtype); k ``[B, T, HQ, K]``."""
    dt = _dtype(k, v, g, beta)
    vr, br = (_rows(x, plan).to(dt) for x in (v, beta))
    H = vr.shape[1]
    kr = _value_heads(_rows(k, plan).to(dt), H)
    G = _gate_rows(chunk_local_cumsum(g, plan), plan, dt)
    w, u = torch.zeros_like(kr), torch.zeros_like(vr)
    for n, c, _ in plan.chunks:
        s, e = plan.chunk_bounds(n, c)
        kc, bc = kr[s:e].transpose(0, 1), br[s:e].T  # [H, C, K], [H, C]
        decay = _pair_decays(G[s:e], log2=False, strict=True)
        pairs = torch.einsum("hic,hjc,hijc->hij", kc, kc, decay.expand(-1, -1, -1, kc.shape[-1]))
        lower = torch.eye(e - s, dtype=dt, device=k.device) + bc[..., None] * pairs
        solve = lambda rhs: torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)  # noqa: E731
        w[s:e] = solve(bc[..., None] * G[s:e].transpose(0, 1).exp() * kc).transpose(0, 1)
        u[s:e] = solve(bc[..., None] * vr[s:e].transpose(0, 1)).transpose(0, 1)
    return w.view(*v.shape[:3], kr.shape[-1]), u.view(v.shape)


def attention(q: Tensor, k: Tensor, g: Tensor, scale: float, plan: SubPieces, *, g_log2: bool = True,
              out_dtype: torch.dtype = torch.float32) -> Tensor:
    """``Aqk [B, T, H, BT]``: per chunk ``scale tril_incl(sum_c q_ic k_jc exp(G_ic - G_jc))``, row i a token,
    column j the j-th token of its chunk (fla's layout of ``chunk_kda_fwd_intra``'s Aqk; zero above the
    diagonal and past the chunk's end). q, k ``[B, T, HQ, K]``; g: G ``[B, T, H]`` or ``[B, T, H, K]``."""
    dt = _dtype(q, k, g)
    G = _gate_rows(g, plan, dt)
    H = G.shape[1]
    qr, kr = (_value_heads(_rows(x, plan).to(dt), H) for x in (q, k))
    out = torch.zeros(plan.tokens, H, plan.chunk_size, dtype=dt, device=q.device)
    for n, c, _ in plan.chunks:
        s, e = plan.chunk_bounds(n, c)
        qc, kc = qr[s:e].transpose(0, 1), kr[s:e].transpose(0, 1)
        decay = _pair_decays(G[s:e], g_log2, strict=False).expand(-1, -1, -1, qc.shape[-1])
        out[s:e, :, :e - s] = scale * torch.einsum("hic,hjc,hijc->ihj", qc, kc, decay)
    return out.view(*g.shape[:3], plan.chunk_size).to(dt if dt == torch.float64 else out_dtype)


def correction_reads(q: Tensor, k: Tensor, w: Tensor, g: Tensor, scale: float, plan: SubPieces, *,
                     aqk: Optional[Tensor] = None, g_log2: bool = True, out_dtype: torch.dtype = torch.float32,
                     precision: str = "tf32x3") -> Tensor:
    """K1: ``Qt_c = scale (q_c * exp(G)) - Aqk_c w_c``.

    Args:
        q, k: ``[B, T, HQ, K]``; w: ``[B, T, H, K]``; g: G ``[B, T, H]`` or ``[B, T, H, K]`` (in-chunk
            cumulative log decay, base 2 if ``g_log2``).
        aqk: ``[B, T, H, BT]`` (:func:`attention`'s), or None to form it here.

    Returns:
        ``Qt [B, T, H, K]`` in ``out_dtype`` (float64 when the inputs are float64).
    """
    dt = _dtype(q, k, w, g)
    A = attention(q, k, g, scale, plan, g_log2=g_log2, out_dtype=dt) if aqk is None else aqk
    G, Ar, wr = _gate_rows(g, plan, dt), _rows(A, plan).to(dt), _rows(w, plan).to(dt)
    qr = _value_heads(_rows(q, plan).to(dt), wr.shape[1])
    out = torch.zeros_like(wr)
    for n, c, _ in plan.chunks:
        s, e = plan.chunk_bounds(n, c)
        keep = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).tril()
        Ac = torch.where(keep[:, None, :], Ar[s:e, :, :e - s], 0.)  # only the causal part of a given Aqk counts
        out[s:e] = scale * qr[s:e] * _exp(G[s:e], g_log2) - torch.einsum("ihj,jhk->ihk", Ac, wr[s:e])
    return out.view(w.shape).to(dt if dt == torch.float64 else out_dtype)


def sub_piece_maps(qt: Tensor, k: Tensor, w: Tensor, g: Tensor, plan: SubPieces, *, g_log2: bool = True,
                   r_dtype: torch.dtype = torch.float32, precision: str = "tf32x3") -> Tuple[Tensor, Tensor]:
    """K2: per sub-piece j, from ``M = I``, chunk by chunk:
    ``R_c = Qt_c M``; ``M <- Diag(exp(G_last)) M - (k_c * exp(G_last - G))^T (w_c M)``; then ``L_j = M``.

    Returns:
        ``R [B, T, H, K]`` (``r_dtype``) and ``L [NS, H, K, K]`` (float32; float64 for float64 inputs).
    """
    dt = _dtype(qt, k, w, g)
    qr, wr = (_rows(x, plan).to(dt) for x in (qt, w))
    H, K = wr.shape[1:]
    kr = _value_heads(_rows(k, plan).to(dt), H)
    G = _gate_rows(g, plan, dt)
    R = torch.zeros(plan.tokens, H, K, dtype=dt, device=k.device)
    L = torch.zeros(plan.num_pieces, H, K, K, dtype=dt, device=k.device)
    for j, (n, c0, nc) in enumerate(plan.pieces):
        M = torch.eye(K, dtype=dt, device=k.device).expand(H, K, K)
        for c in range(c0, c0 + nc):
            s, e = plan.chunk_bounds(n, c)
            R[s:e] = torch.einsum("thk,hkl->thl", qr[s:e], M)
            last = G[e - 1]  # [H, K or 1]
            wm = torch.einsum("thk,hkl->thl", wr[s:e], M)
            kd = kr[s:e] * _exp(last - G[s:e], g_log2)
            M = _exp(last, g_log2)[..., None] * M - torch.einsum("thk,thl->hkl", kd, wm)
        L[j] = M
    return R.view(qt.shape).to(dt if dt == torch.float64 else r_dtype), L


def prefix_maps(L: Tensor, plan: SubPieces, *, precision: str = "tf32x3") -> Tuple[Tensor, Tensor]:
    """K3: ``P_j = L_{j-1} ... L_0`` over each segment's sub-pieces (``P_0 = I``) and the segment's
    ``M = L_{S-1} ... L_0`` (the identity for an empty segment).

    Returns:
        ``P [NS, H, K, K]`` and ``M [N, H, K, K]`` in L's dtype.
    """
    H, K = L.shape[1], L.shape[-1]
    P = torch.empty_like(L)
    M = torch.eye(K, dtype=L.dtype, device=L.device).repeat(plan.num_segments, H, 1, 1)
    for n in range(plan.num_segments):
        for j in range(plan.piece_offsets[n], plan.piece_offsets[n + 1]):
            P[j] = M[n]
            M[n] = L[j] @ M[n]
    return P, M


def output_correction(o0: Tensor, R: Tensor, P: Tensor, S_in: Tensor, plan: SubPieces, *,
                      precision: str = "tf32x3", out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """K4: ``o_c = o^0_c + R_c X_j`` with ``X_j = P_j S_in[segment of j]``, summed in the compute dtype
    and rounded once.

    Args:
        o0: ``[B, T, H, V]``, the output from a zero entering state; R: ``[B, T, H, K]``;
        P: ``[NS, H, K, K]``; S_in: ``[N, H, K, V]``.

    Returns:
        ``o [B, T, H, V]`` in ``out_dtype`` (default o0's dtype).
    """
    dt = _dtype(o0, R, P, S_in)
    o, Rr = _rows(o0, plan).to(dt).clone(), _rows(R, plan).to(dt)
    X = P.to(dt) @ S_in.to(dt)[[n for n, _, _ in plan.pieces]] if plan.num_pieces else None
    for n, c, j in plan.chunks:
        s, e = plan.chunk_bounds(n, c)
        o[s:e] += torch.einsum("thk,hkv->thv", Rr[s:e], X[j])
    return o.view(o0.shape).to(out_dtype or o0.dtype)


def entering_grad(R: Tensor, P: Tensor, do: Tensor, plan: SubPieces, *, precision: str = "tf32x3") -> Tensor:
    """K5: ``A[n] = sum_{j in n} P_j^T sum_{c in j} R_c^T do_c``, the gradient of ``<do, o>`` with
    respect to segment n's entering state.

    Returns:
        ``A [N, H, K, V]`` in float32 (float64 for float64 inputs).
    """
    dt = _dtype(R, P, do)
    Rr, dor = _rows(R, plan).to(dt), _rows(do, plan).to(dt)
    H, K, V = Rr.shape[1], Rr.shape[2], dor.shape[-1]
    Y = torch.zeros(plan.num_pieces, H, K, V, dtype=dt, device=R.device)
    for n, c, j in plan.chunks:
        s, e = plan.chunk_bounds(n, c)
        Y[j] += torch.einsum("thk,thv->hkv", Rr[s:e], dor[s:e])
    A = torch.zeros(plan.num_segments, H, K, V, dtype=dt, device=R.device)
    for j, (n, _, _) in enumerate(plan.pieces):
        A[n] += P[j].to(dt).transpose(-1, -2) @ Y[j]
    return A


def fused_maps(q: Tensor, k: Tensor, w: Tensor, g: Tensor, scale: float, plan: SubPieces, *,
               aqk: Optional[Tensor] = None, g_log2: bool = True, r_dtype: torch.dtype = torch.float32,
               precision: str = "tf32x3") -> Tuple[Tensor, Tensor]:
    """K1 and K2 in one call (the kernels' ``fused_maps``): ``R`` and ``L`` from the queries, Qt exact
    (never rounded to a stored dtype)."""
    qt = correction_reads(q, k, w, g, scale, plan, aqk=aqk, g_log2=g_log2, precision=precision)
    return sub_piece_maps(qt, k, w, g, plan, g_log2=g_log2, r_dtype=r_dtype, precision=precision)


def piece_transition(q: Tensor, k: Tensor, w: Tensor, g: Tensor, scale: float, plan: SubPieces, *,
                     aqk: Optional[Tensor] = None, g_log2: bool = True, r_dtype: torch.dtype = torch.float32,
                     precision: str = "tf32x3", fused: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """K1..K3 in one call, what the forward needs before the scan: ``R``, ``P`` and the segments' ``M``
    (``fused``: Qt exact, as :func:`fused_maps`; else kept in ``r_dtype``, as R)."""
    if fused:
        R, L = fused_maps(q, k, w, g, scale, plan, aqk=aqk, g_log2=g_log2, r_dtype=r_dtype, precision=precision)
    else:
        qt = correction_reads(q, k, w, g, scale, plan, aqk=aqk, g_log2=g_log2, out_dtype=r_dtype,
                              precision=precision)
        R, L = sub_piece_maps(qt, k, w, g, plan, g_log2=g_log2, r_dtype=r_dtype, precision=precision)
    P, M = prefix_maps(L, plan, precision=precision)
    return R, P, M
