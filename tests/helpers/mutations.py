"""Mutation check of the fast tier: does a realistic one-line bug fail a test?

Each mutation below is a bug one could write (a product in the wrong order, a transpose dropped, a
constant in the wrong unit). The check copies the repository's files (those git tracks or would track) into a temporary folder,
applies one mutation there (the working tree is never touched), runs the fast tier,
``python -m pytest -m "not slow" -x -q``, on the copy, and reports whether some test failed, which one
first, and how long it took. A mutation that leaves the fast tier green is a gap in the tests::

    python -m tests.helpers.mutations                      # every mutation, one after another
    python -m tests.helpers.mutations dense-compose-order  # some of them, by name
    python -m tests.helpers.mutations --list
    python -m tests.helpers.mutations --tier full ...      # against the full suite instead
    python -m tests.helpers.mutations --every-failure ...  # every test that fails, not just the first

It exits non-zero if a mutation survives (or no longer applies: the code it rewrites has changed, so
update the mutation). To check a new path by hand: add a ``Mutation`` here naming the file, the exact
text and its bug, and run it by name. docs/testing.md lists what the mutations are and what kills them.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # exact text, found once in the file
    new: str
    bug: str


MUTATIONS = [
    Mutation("dense-compose-order", "megatron_zeco/comm/transition.py",
             "return torch.matmul(later, earlier)", "return torch.matmul(earlier, later)",
             "a dense transition composed in the wrong order (M_1 M_2 for M_2 M_1)"),
    Mutation("dense-transpose-dropped", "megatron_zeco/comm/transition.py",
             "return M.transpose(-1, -2)", "return M",
             "the backward scan applies M instead of M^T"),
    Mutation("chain-combine-drops-incoming", "megatron_zeco/comm/all_scan.py",
             "return kind.combine(gamma[slot], delta[slot], x, block)",
             "return kind.combine(gamma[slot], delta[slot], x * 0, block)",
             "the chain's combine ignores the state that arrived (S_out = E)"),
    Mutation("packed-document-not-reset", "megatron_zeco/cp/packed.py",
             "through.append(entered[-1] and not cuts)", "through.append(entered[-1])",
             "a document starting inside a piece does not reset the state passed on"),
    Mutation("halo-from-next-rank", "megatron_zeco/comm/halo.py",
             "out.append((n * width + width - (a - position), *owner(position)))",
             "source = position + (b - a) if position + (b - a) < held[-1][1] else position\n"
             "                out.append((n * width + width - (a - position), *owner(source)))",
             "the convolution's halo taken from the tokens after the piece (the next rank's)"),
    Mutation("wait-never-gives-up", "megatron_zeco/kernels/scan_hop.py",
             "            late = 2\n", "            late = 0\n",
             "a bounded wait that never gives up (waits for a stalled peer however long it takes)"),
    Mutation("give-up-not-poisoned", "megatron_zeco/kernels/scan_hop.py",
             'return tl.where(failed, float("nan"), x)', "return x",
             "a wait that gave up delivers the stale state as if it had arrived"),
    Mutation("infiniband-latency-ms", "megatron_zeco/comm/shape.py",
             "INFINIBAND = Link(latency=5e-6,", "INFINIBAND = Link(latency=5e-3,",
             "InfiniBand latency in milliseconds where microseconds are meant (x1000)"),
    Mutation("infiniband-bandwidth-bits", "megatron_zeco/comm/shape.py",
             "INFINIBAND = Link(latency=5e-6, bandwidth=50e9)", "INFINIBAND = Link(latency=5e-6, bandwidth=50e9 / 8)",
             "InfiniBand bandwidth read as bits where bytes are meant (/8)"),
    Mutation("piece-share-from-oldest-file", "megatron_zeco/cost_model/calibration.py",
             'for r in sorted(rows, key=lambda r: (r["date"], r["file"])):',
             'for r in sorted(rows, key=lambda r: (r["date"], r["file"]), reverse=True):',
             "the cost model prices a delta rule's piece by the oldest profile, a piece since replaced"),
    Mutation("overlap-counted-over-send-recv", "megatron_zeco/cost_model/model.py",
             'built = strategy == "zeco" and TRANSPORTS[sw.transport].device', 'built = strategy == "zeco"',
             "the cost model hides the scan behind the in-chunk work over send/recv too, where the overlap is off"),
    Mutation("overlap-counted-where-off", "megatron_zeco/cost_model/model.py",
             " and RULES[w.op.rules].auto_overlap", "",
             "the cost model hides an operator's scan behind its in-chunk work where its rules leave the overlap off"),
    Mutation("dense-hop-kernel-over-send-recv", "megatron_zeco/cost_model/model.py",
             "return self.dense_hop[0] / K if device and self.dense_hop else self.apply_time(K)",
             "return self.dense_hop[0] / K if self.dense_hop else self.apply_time(K)",
             "the cost model charges the device transports' dense hop kernel for a combine over send/recv too, where "
             "PyTorch's products make it"),
    Mutation("hop-pace-beside-local-work-ignored", "megatron_zeco/cost_model/model.py",
             "hidden * t / aside if built", "hidden * t if built",
             "the cost model lets the scan advance beside the in-chunk work at the pace of a hop alone"),
    Mutation("overlap-off-for-the-gated-delta-rule", "megatron_zeco/cp/config.py",
             "auto_transport=Transport.SEND_RECV, auto_overlap=True),\n    \"kda\"",
             "auto_transport=Transport.SEND_RECV, auto_overlap=False),\n    \"kda\"",
             "overlap=None leaves the gated delta rule's hops on the current stream, behind the work they could "
             "run beside"),
    Mutation("overlap-off-for-kda", "megatron_zeco/cp/config.py",
             "blocks=\"columns\", auto_transport=Transport.SEND_RECV,\n                 auto_overlap=True)",
             "blocks=\"columns\", auto_transport=Transport.SEND_RECV,\n                 auto_overlap=False)",
             "overlap=None leaves KDA's hops on the current stream, behind the work they could run beside"),
    Mutation("scan-stream-default-priority", "megatron_zeco/cp/scan.py",
             "torch.cuda.Stream(device, priority=-1)", "torch.cuda.Stream(device)",
             "the scans' side stream of default priority: its hops queue behind the local work's pending blocks"),
    Mutation("device-tree-composes-without-own-map", "megatron_zeco/comm/peer_hierarchical.py",
             "([t], [own], [scratch]), y, (K * W, W, (K * W, W, V)))", "([t], [own], [scratch]), y, (K * W, W, (K * W, W, 0)))",
             "phase B of the device hierarchical scan composes the earlier segments' map without the leader's own state"),
    Mutation("device-tree-skips-entering-state", "megatron_zeco/comm/peer_hierarchical.py",
             "x = self.kind.unpack(self.states[j], V)[1]\n", "x = self.kind.unpack(self.states[j], V)[1] * 0\n",
             "the device hierarchical scan leaves out the state entering each segment but the first"),
    Mutation("device-tree-products-before-local-work", "megatron_zeco/comm/peer_hierarchical.py",
             "    if at == len(plan) and while_waiting is not None:\n        while_waiting()\n    with beside():\n"
             "        run.finish(inputs)\n",
             "    with beside():\n        run.finish(inputs)\n    if at == len(plan) and while_waiting is not None:\n"
             "        while_waiting()\n",
             "the device hierarchical scan's local products queued on the side stream before the local work"),
    Mutation("device-tree-sends-a-stale-map", "megatron_zeco/comm/peer_hierarchical.py",
             "        elif hop.kind == \"fold\":  # made by a local product: sent by a launch of its own\n"
             "            maker[hop.segment] = None\n", "",
             "a segment's map, composed on the host side of a round, sent by the launch that made the map before it"),
    Mutation("hop-delta-read-past-its-columns", "megatron_zeco/kernels/scan_hop.py",
             "in_block[:, None] & (cols[None, :] < DV)", "in_block[:, None] & (cols[None, :] < DV + 1)",
             "a hop reads a delta narrower than the state past its columns instead of as zero there"),
    Mutation("dense-hop-map-rows-as-matrix-rows", "megatron_zeco/kernels/scan_hop.py",
             "*_delta_layout(delta_layout, s_stride, V), K if m_row is None else m_row,",
             "*_delta_layout(delta_layout, s_stride, V), K,",
             "a dense compose reads the transition inside a map with K-element rows instead of the map's"),
    Mutation("device-tree-skips-a-last-segments-chain", "megatron_zeco/comm/peer_hierarchical.py",
             "if j > 0 and j == M - 1 and len(indices) == 1:", "if j > 0 and j == M - 1:",
             "the device hierarchical scan skips phase A in a last segment of several pieces"),
    Mutation("rounds-compose-ignores-own-decays", "megatron_zeco/kernels/scan_hop.py",
             "x = t[:, None] * x + own_e", "x = x + own_e",
             "a leader's rounds launch composes a received map without its own map's decays"),
    Mutation("rounds-merge-across-segments", "megatron_zeco/comm/peer_hierarchical.py",
             "run(hop) == run(steps[0])", "run(hop)[0] == run(steps[0])[0]",
             "a rounds launch takes in the next launch of another segment this rank leads"),
    Mutation("dense-rounds-compose", "megatron_zeco/comm/peer_hierarchical.py",
             "return _rounds(_fused(hops, walk), composes=not dense)", "return _rounds(_fused(hops, walk))",
             "a dense map's rounds of B go in one rounds launch, whose column tiles only pass maps on"),
    Mutation("dense-hop-precision-dropped", "megatron_zeco/comm/peer.py",
             "dict(precision=dense_precision(self.route.precision))) if ch.dense", "{}) if ch.dense",
             "the chain's dense hops multiply in three TF32 passes whatever the pieces' precision"),
    Mutation("map-precision-always-float32", "megatron_zeco/kernels/__init__.py",
             'return "input" if dtype in (torch.float16, torch.bfloat16) else "tf32x3"', 'return "tf32x3"',
             "pieces of 16-bit inputs and their scans multiply in float32 accuracy, not as fla's state pass rounds"),
    Mutation("dense-rounds-tiles-as-rows", "megatron_zeco/kernels/scan_hop.py",
             "        tile = dict(ROWS=K, BR=BR, BV=BC, COLS=cols, num_warps=min(16, max(1, BR * BC // 256)))\n", "",
             "a rounds launch moves a dense map in row tiles where the dense hop reads column tiles"),
    Mutation("walk-turn-in-one-segment", "megatron_zeco/comm/hierarchical.py",
             "                    or any(self.owners[k][0] == rank for k in self.segments[-1]):",
             "                    or False:",
             "the hierarchical walk keeps a zigzag turn's two runs on a node in one segment (the model cuts them)"),
    Mutation("zigzag-unshard-slots-swapped", "megatron_zeco/comm/layout.py",
             "ordered.append(slots[rank][slot])", "ordered.append(slots[rank][-1 - slot])",
             "unshard puts a rank's two zigzag pieces back in the wrong order"),
    Mutation("delta-prefix-map-off-by-one", "megatron_zeco/kernels/delta_correction.py",
             "        tl.store(P + base + o_k[:, None] * K + o_c[None, :], b_P, mask=m_k[:, None] & m_c[None, :])\n"
             "        b_L = tl.load(L + base + o_k[:, None] * K + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.)\n"
             "        b_P = _dot(b_L, b_P, tl.zeros([BK, BC], dtype=tl.float32), PRECISION, INTERPRETED)\n",
             "        b_L = tl.load(L + base + o_k[:, None] * K + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.)\n"
             "        b_P = _dot(b_L, b_P, tl.zeros([BK, BC], dtype=tl.float32), PRECISION, INTERPRETED)\n"
             "        tl.store(P + base + o_k[:, None] * K + o_c[None, :], b_P, mask=m_k[:, None] & m_c[None, :])\n",
             "the delta rules' sub-piece prefix P_j includes sub-piece j's own map"),
    Mutation("delta-fourth-row-tile-offset", "megatron_zeco/kernels/delta_correction.py",
             "b_M4 = _maps_update(k, g, rows_k, rows, last, m_t, b_M4, b_wm, 3 * BK,",
             "b_M4 = _maps_update(k, g, rows_k, rows, last, m_t, b_M4, b_wm, 2 * BK,",
             "the sub-piece map's fourth row tile updated with the third tile's keys"),
    Mutation("delta-segment-gradient-skips-first-sub-piece", "megatron_zeco/kernels/delta_correction.py",
             "    for j in range(j0, j1):\n        b_A += tl.load(Z",
             "    for j in range(j0 + 1, j1):\n        b_A += tl.load(Z",
             "a packed segment's entering gradient A_n leaves out its first sub-piece's term"),
    Mutation("kda-channel-decay-on-columns", "megatron_zeco/kernels/delta_correction.py",
             "b_M = b_M * _exp(b_gl, G_LOG2)[:, None]", "b_M = b_M * _exp(b_gl, G_LOG2)[None, :]",
             "a chunk's decay per key channel applied to the columns of the sub-piece map (M Diag(a)), not its "
             "rows (Diag(a) M)"),
    Mutation("fused-maps-drop-in-chunk-attention", "megatron_zeco/kernels/delta_correction.py",
             "b_r = b_r - _dot(b_A, b_wm,", "b_r = b_r + 0 * _dot(b_A, b_wm,",
             "K2 from the queries forms R as scale (q * exp(G)) M alone, without the in-chunk attention's "
             "- Aqk (w M)"),
    Mutation("fused-maps-in-chunk-decay-reversed", "megatron_zeco/kernels/delta_correction.py",
             "_exp(b_gq[:, None] - b_gq[None, :], G_LOG2)", "_exp(b_gq[None, :] - b_gq[:, None], G_LOG2)",
             "K2 from the queries decays q_i k_j^T by exp(G_j - G_i) (a gate per head), not exp(G_i - G_j)"),
    Mutation("rounds-share-no-link", "megatron_zeco/cost_model/model.py",
             "load[end] += tile", "load[end] = tile",
             "the cost model lets each of a rank's tiled messages between nodes (its rounds, its send into the "
             "next node, the lanes' parts it takes in) have its link to itself"),
    Mutation("lane-tile-ignores-lane", "megatron_zeco/kernels/scan_hop.py",
             "return (LANE + LANES * (at // TILES)) * TILES + at % TILES",
             "return (LANES * (at // TILES)) * TILES + at % TILES",
             "every lane of the hierarchical scan's B and C moves lane 0's states"),
    Mutation("lane-parts-into-fresh-maps", "megatron_zeco/comm/peer_hierarchical.py",
             "into = self._map() if hop.lane is None else self._entering(hop.segment)", "into = self._map()",
             "each lane's part of the state entering a segment lands in a map of its own, the others' parts lost"),
    Mutation("gather-acks-into-one-region", "megatron_zeco/comm/peer_hierarchical.py",
             'sent = region(src, f"gather {_SEND}", ranks.index(me), seg.slot_of(j, src))',
             'sent = region(src, f"gather {_SEND}", 0, seg.slot_of(j, src))',
             "every rank of a segment acknowledges a taker's part of the state into the region of the taker's first "
             "send: the acknowledgements of the all-gather's sends collide"),
    Mutation("step-messages-own-links", "megatron_zeco/cost_model/model.py",
             "c.link(a, b).time(what[1] * part * nbytes / blocks)", "c.link(a, b).time(part * nbytes / blocks)",
             "the cost model lets each of a rank's messages of one step (the all-gather's, a leader's lanes) have "
             "its link to itself"),
    Mutation("kda-decay-without-exp", "megatron_zeco/kda/layer.py",
             "g = -self.A_log.to(fp).exp().unsqueeze(-1) * F.softplus(",
             "g = -self.A_log.to(fp).unsqueeze(-1) * F.softplus(",
             "the KDA layer's decay rate taken as A_log, not exp(A_log)"),
    Mutation("kda-output-gate-silu", "megatron_zeco/kda/layer.py",
             'self.config.layernorm_epsilon, "sigmoid")', 'self.config.layernorm_epsilon, "silu")',
             "the KDA layer's output gate a SiLU (GLA's and Gated DeltaNet's) instead of a sigmoid"),
    Mutation("gated-norm-activations-swapped", "megatron_zeco/common/norm.py",
             'F.silu(gate) if activation == "silu" else gate.sigmoid()',
             'gate.sigmoid() if activation == "silu" else F.silu(gate)',
             "the gated output norm applies the other layer's gate activation (sigmoid for Gated DeltaNet's SiLU)"),
    Mutation("gated-norm-eps-inside-root-dropped", "megatron_zeco/common/norm.py",
             "y = F.rms_norm(x.to(fp), (x.shape[-1],), weight.to(fp), eps)",
             "y = F.rms_norm(x.to(fp), (x.shape[-1],), weight.to(fp))",
             "the gated output norm ignores the configured eps (torch's default)"),
    Mutation("untuned-passes-over-any-error", "megatron_zeco/common/tuning.py",
             "if (compiler and _COMPILER_FAILURE not in str(e)) or i == len(self.configs) - 1:",
             "if i == len(self.configs) - 1:",
             "the tests' untuned configs pass over any error of a config, not only a failure of Triton's compiler"),
    Mutation("no-op-hook-counted-as-local-work", "megatron_zeco/cp/piece.py",
             "if getattr(type(piece), hook, None) is getattr(Piece, hook):",
             "if getattr(type(piece), hook, None) is None:",
             "a piece hook kept as the protocol's no-op counts as local work (the scan's hops go aside for nothing)"),
    Mutation("aside-waiting-hop-after-local-work", "megatron_zeco/comm/peer.py",
             "at = min(at + 1, len(plan))", "at = min(at, len(plan))",
             "with a side stream, the first hop that waits for a peer is issued after the local work, not beside it"),
    Mutation("aside-every-hop-before-local-work", "megatron_zeco/comm/peer.py",
             "at = min(at + 1, len(plan))", "at = len(plan)",
             "with a side stream, every hop is issued before the local work (on one hardware queue a hop waiting "
             "for the one before it holds the local work up)"),
    Mutation("gla-gate-not-normalised", "megatron_zeco/gla/layer.py",
             "g = F.logsigmoid(g.to(fp)) / self.gate_normalizer", "g = F.logsigmoid(g.to(fp))",
             "the GLA layer's log forget gate not divided by its normaliser (16)"),
    Mutation("conv-identity-oldest-tap", "megatron_zeco/mcore/common.py",
             "weight[..., -1] = 1.0", "weight[..., 0] = 1.0",
             "the identity convolution's one tap on the oldest token (a shift by W - 1) instead of the current one"),
    Mutation("train-iters-alias-dropped", "megatron_zeco/training/arguments.py",
             'aliases=("--train-iters",))', "aliases=())",
             "the main job's --train-iters (Megatron-LM's spelling of --steps) no longer parsed"),
    Mutation("seq-len-check-ignores-piece-split", "megatron_zeco/training/arguments.py",
             "pieces = as_layout(cfg.layout).num_pieces(cfg.cp) * split if cfg.cp > 1 else 1",
             "pieces = as_layout(cfg.layout).num_pieces(cfg.cp) if cfg.cp > 1 else 1",
             "a --seq-len that divides into the pieces but not into their --piece-split sub-pieces accepted"),
]

TIERS = {"fast": ["-m", "not slow"], "full": []}


def _copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)


def _apply(tree: Path, m: Mutation) -> Optional[str]:
    path = tree / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        return f"the text to mutate occurs {text.count(m.old)} times in {m.path} (expected once)"
    path.write_text(text.replace(m.old, m.new))
    return None


def _failures(output: str, every: bool) -> str:
    failed = [line.split(" - ")[0] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    if failed:
        return "\n    ".join(failed) if every else failed[0]
    return output.strip().splitlines()[-1] if output.strip() else "(no output)"


def run(m: Mutation, tier: str, timeout: float, every_failure: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        problem = _apply(tree, m)
        if problem:
            return dict(name=m.name, outcome="stale", detail=problem, seconds=0.0)
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
        where = subprocess.run([sys.executable, "-c", "import megatron_zeco; print(megatron_zeco.__file__)"],
                               cwd=tree, env=env, capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(tree)):
            return dict(name=m.name, outcome="error", detail=f"the copy is not what imports: {where}", seconds=0.0)
        # tests/test_mutations.py checks that each mutation's text is still in the code: on a mutated copy it
        # fails by construction, before the tests after it in order (tests/test_train.py) could.
        cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "--ignore",
               "tests/test_mutations.py", *TIERS[tier]]
        cmd += [] if every_failure else ["-x"]
        start = time.monotonic()
        try:
            done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return dict(name=m.name, outcome="timed out", detail=f"no result in {timeout:.0f} s",
                        seconds=time.monotonic() - start)
        seconds = time.monotonic() - start
        if done.returncode == 0:
            return dict(name=m.name, outcome="SURVIVED", detail="every test passed", seconds=seconds)
        detail = _failures(done.stdout + done.stderr, every_failure)
        return dict(name=m.name, outcome="killed", detail=detail, seconds=seconds)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--tier", choices=sorted(TIERS), default="fast", help="which tests must kill them")
    parser.add_argument("--every-failure", action="store_true",
                        help="run the whole tier, not up to the first failure, and list every test that failed")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutation before giving up")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:32s} {m.path}: {m.bug}")
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; --list shows them")
    survivors = 0
    for m in [by_name[n] for n in args.names] or MUTATIONS:
        r = run(m, args.tier, args.timeout, args.every_failure)
        survivors += r["outcome"] != "killed"
        print(f"{r['name']:32s} {r['outcome']:9s} {r['seconds']:6.1f} s  {r['detail']}", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
