"""Strategies ``zeco`` and ``lasp2``: pass states, never activations.

Forward, on each rank and for each piece it holds:
  1. summary of the piece from a zero state: ``E`` and the linear part of its map (GLA: a
     decay ``gamma``; the gated delta rule: a K x K matrix ``M``, ``comm/transition.py``);
  2. scan across ranks: ``S_in(p+1) = T_p S_in(p) + E_p``;
  3. the local op started from ``S_in``: exactly the output over the whole sequence.
Backward runs the same scan in reverse on ``dL/dS_in = A_p + T_p^T D(p)``
(``A_p`` from the output gradient only), then the local backward from ``S_in`` with
final-state gradient ``D(p)`` gives every input's exact gradient.

A rank's pieces (two under zigzag) have equal lengths and run as one batch: one launch of each
local operation per layer whatever the layout. With ``piece_split`` s > 1 each piece runs as s
consecutive sub-pieces in that batch, joined locally by the scan's own recurrence (their
summaries fold into the piece's before the scan; the piece's incoming state, and in backward the
outgoing state's gradient, unfold to the sub-pieces after it): exact, and on GPUs fla's
sequential state kernels get s times more independent sequences. Packed sequences
(``packed.Packing``) run as one varlen launch over the pieces' document segments instead, and
the scan carries one chain per document where each document is split on its own.

``zeco`` scans with the pipelined All-Scan (messages, or stores into peer memory on one node:
``comm/peer.py``); ``lasp2`` with an all-gather.
"""

import torch

from ..comm import all_scan, gather_scan
from ..comm.transition import transition_of
from ..kernels import map_precision
from .local import initial_state_grad
from .piece import local_work


class ScanOp(torch.autograd.Function):
    """A scan strategy over the local pieces ``make_piece(*inputs, scale=, cu_seqlens=, cu_seqlens_cpu=)``
    builds (an operator's :meth:`~megatron_zeco.cp.operator.Operator.make_piece`; each a
    :class:`~megatron_zeco.cp.operator.Piece`): the inputs are per-token tensors ``[B, T, H, ...]``, q
    first. Returns ``o`` and the final state (zeros where the rank does not end the chain); gradients for
    ``h0`` and every input."""

    @staticmethod
    def forward(ctx, make_piece, plan, call, h0, *inputs):
        n = plan.pieces_per_rank
        pieces = _Pieces(n, call.piece_split) if call.packing is None else call.packing
        q = inputs[0]
        piece = make_piece(*(pieces.local(x) for x in inputs), scale=call.scale, cu_seqlens=pieces.cu,
                           cu_seqlens_cpu=pieces.cu_cpu)
        E, gamma = pieces.summaries(piece.E, piece.transition)
        ctx.h0_dtype = None if h0 is None else h0.dtype
        h0 = None if h0 is None else h0.to(E.dtype)
        S_in = torch.empty_like(E)  # the scan writes each slot's part of it
        ctx.precision = map_precision(q.dtype)  # the maps' products, in the pieces and in the scans' hops
        _, last = _scan(_slots(gamma, n), _slots(E, n), h0, plan, reverse=False, out=_slots(S_in, n),
                        between=local_work(piece, "before_output"), precision=ctx.precision)
        o = piece.output(pieces.initial_states(S_in))
        ctx.save_for_backward(gamma)
        ctx.n, ctx.pieces, ctx.piece, ctx.plan, ctx.call = n, pieces, piece, plan, call
        if last is None and call.output_final_state:  # the caller broadcasts it from the rank that has it
            last = E.new_zeros(q.shape[0], *E.shape[1:])
        return o.reshape(*q.shape[:3], o.shape[-1]), last

    @staticmethod
    def backward(ctx, do, dht):
        n, pieces, piece, (gamma,) = ctx.n, ctx.pieces, ctx.piece, ctx.saved_tensors
        A = pieces.entering_grads(piece.entering_grad(pieces.local(do)))
        dht = dht.to(A.dtype) if ctx.call.output_final_state else None
        D = torch.empty_like(A)
        gamma_t = transition_of(gamma, A).transpose(gamma)  # dS_in = T^T dS_out + A
        Ds, dh0 = _scan(_slots(gamma_t, n), _slots(A, n), dht, ctx.plan, reverse=True, out=_slots(D, n),
                        between=local_work(piece, "before_grads"), precision=ctx.precision)
        grads = piece.grads(pieces.final_grads(D))
        grads = [x.reshape(do.shape[0], do.shape[1], *x.shape[2:]) for x in grads]
        return (None, None, None, initial_state_grad(ctx, dh0, Ds[0], index=3), *grads)


class _Pieces:
    """A rank's n equal pieces of B sequences, each as ``split`` consecutive sub-pieces: B*n*split
    batch entries of the local operations (the dense counterpart of ``packed.Packing``: no resets).

    Sub-pieces j = 0..s-1 of a piece are joined by ``S_in(j+1) = gamma_j S_in(j) + E_j`` (forward)
    and ``D(j) = A_(j+1) + gamma_(j+1) D(j+1)`` (backward), in float32 like the scan.
    """

    cu = cu_cpu = None

    def __init__(self, n, split=1):
        self.n, self.split = n, split

    def local(self, x):
        return _as_batch(x, self.n * self.split)

    def summaries(self, E, gamma):
        """Per sub-piece ``(E, gamma)`` -> per piece (the sub-pieces' maps composed in order)."""
        if self.split == 1:
            return E, gamma
        self._E, self._gamma = _subs(E, self.split), _subs(gamma, self.split)
        e, g = self._E[0], self._gamma[0]
        for E_j, gamma_j in zip(self._E[1:], self._gamma[1:]):
            e, g = torch.addcmul(E_j, gamma_j.unsqueeze(-1), e), g * gamma_j
        return e, g

    def initial_states(self, S_in):
        """Per piece ``S_in`` -> per sub-piece."""
        if self.split == 1:
            return S_in
        xs = [S_in]
        for E_j, gamma_j in zip(self._E[:-1], self._gamma[:-1]):
            xs.append(torch.addcmul(E_j, gamma_j.unsqueeze(-1), xs[-1]))
        return torch.stack(xs, dim=1).flatten(0, 1)

    def entering_grads(self, A):
        """Per sub-piece local ``dL/dS_in`` -> per piece."""
        if self.split == 1:
            return A
        self._A = _subs(A, self.split)
        a = self._A[-1]
        for A_j, gamma_j in zip(self._A[-2::-1], self._gamma[-2::-1]):
            a = torch.addcmul(A_j, gamma_j.unsqueeze(-1), a)
        return a

    def final_grads(self, D):
        """Per piece gradient of the state leaving it -> per sub-piece."""
        if self.split == 1:
            return D
        ds = [D]
        for A_j, gamma_j in zip(self._A[:0:-1], self._gamma[:0:-1]):
            ds.append(torch.addcmul(A_j, gamma_j.unsqueeze(-1), ds[-1]))
        return torch.stack(ds[::-1], dim=1).flatten(0, 1)


def _subs(x, split):
    """``[N*split, ...]`` -> the ``split`` sub-pieces' ``[N, ...]``."""
    return x.view(-1, split, *x.shape[1:]).unbind(1)


def _as_batch(x, n):
    """``[B, n*T', ...]`` -> ``[B*n, T', ...]``: the rank's n pieces as batch entries."""
    return x.reshape(x.shape[0] * n, x.shape[1] // n, *x.shape[2:])


def _slots(x, n):
    """``[B*n, ...]`` -> per local slot ``[B, ...]``."""
    return list(x.view(-1, n, *x.shape[1:]).unbind(1))


_SIDE_STREAMS = {}


def scan_stream(device: torch.device) -> "torch.cuda.Stream":
    """The side stream of ``device``'s scans (made on first use), of the highest priority: a hop kernel on it,
    on few programs, is dispatched ahead of the local work's pending blocks once its dependencies clear
    (the local work would otherwise fill the SMs first and keep them)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=-1)  # lower is higher; torch clamps
    return _SIDE_STREAMS[device]


def _scan(gamma, delta, init, plan, reverse, out, between, precision):
    """The scan, with ``between()`` (local work that needs no scan result, or None: none) issued where
    the rank would wait: All-Scan calls it before the rank first waits for a peer, the all-gather scan
    after; ``precision``: the pieces' map precision, which the device hops' dense products follow.

    With ``plan.overlap`` on CUDA and local work to hide, the whole scan runs on a side stream alongside
    ``between()``: over the device transports every hop kernel, on a few SMs, the first that waits for a
    peer spinning beside the local work; over NCCL the messages. The current stream then waits for the
    side stream (no host synchronisation); what the side stream allocated is marked as used on the
    current one.
    """
    use_all_scan = plan.strategy.all_scan
    route = plan.route(f"{plan.name}: {'zeco All-Scan' if use_all_scan else 'lasp2 all-gather scan'} "
                       f"({'backward' if reverse else 'forward'})", precision)
    side, device = None, delta[0].device
    if plan.overlap and delta[0].is_cuda and between is not None:
        side = scan_stream(device)
    if use_all_scan and (side is None or plan.transport.device):
        return all_scan(gamma, delta, init, route, reverse=reverse, out=out, while_waiting=between, aside=side)
    scan = all_scan if use_all_scan else gather_scan
    if side is None:  # the all-gather scan
        result = scan(gamma, delta, init, route, reverse=reverse, out=out)
        if between is not None:
            between()
        return result
    main = torch.cuda.current_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        states, last = scan(gamma, delta, init, route, reverse=reverse, out=out)
    between()
    main.wait_stream(side)
    for t in (*states, last):
        if t is not None:
            t.record_stream(main)
    return states, last
