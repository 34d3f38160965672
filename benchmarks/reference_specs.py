"""Megatron-Core's own Gated DeltaNet, with its own context parallelism, as a ``HybridModel`` stack built
from Megatron-Core linears and norms: the comparison row of ``throughput.py --model gdn-1b`` on machines
without TransformerEngine (Megatron's ``hybrid_stack_spec`` builds every layer from TE modules).

    pretrain_hybrid.py --spec benchmarks.reference_specs megatron_gdn_hybrid_stack_local_spec ...

The stack is ``megatron_zeco.specs.gdn_hybrid_stack_local_spec`` with one change: the ``G`` layers' token
mixer is Megatron's ``GatedDeltaNet`` itself (its head all-to-all over the CP ranks, fla's kernels on each
rank's heads over the whole sequence) instead of ``ZecoGatedDeltaNet``. The layer around it, the norms,
the MLPs, the softmax layers and the parameters are the same modules, so two runs differ only in the
mixer's context parallelism. Run from the repository root (``benchmarks`` on ``PYTHONPATH``, as
``examples/pretrain_hybrid_gla.sh`` puts it).
"""

from dataclasses import replace

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_zeco.specs import gdn_hybrid_stack_local_spec


def megatron_gdn_stack(ours: ModuleSpec = gdn_hybrid_stack_local_spec) -> ModuleSpec:
    """``ours`` (a Gated DeltaNet ``HybridStack`` spec of this package, local modules) with Megatron's own
    ``GatedDeltaNet`` as the ``G`` layers' mixer, at its own defaults (no ZeCO knobs). On a megatron-core
    without HybridModel or GatedDeltaNet, ``ours`` is the package's stand-in that names the release to
    install when built, and is returned as it is."""
    if ours.submodules is None:
        return ours
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    g_layer = ours.submodules.gdn_layer
    mixer = replace(g_layer.submodules.self_attention, module=GatedDeltaNet, params={})
    g_layer = replace(g_layer, submodules=replace(g_layer.submodules, self_attention=mixer))
    return replace(ours, submodules=replace(ours.submodules, gdn_layer=g_layer))


megatron_gdn_hybrid_stack_local_spec = megatron_gdn_stack()
