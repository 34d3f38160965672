"""Models built from this package's specs: Megatron-Core's ``HybridModel`` for one pipeline stage.

(``GPTModel`` needs no builder: pass a layer spec of :mod:`megatron_zeco.specs` as its
``transformer_layer_spec``.)
"""

from typing import Optional

from .mcore import optional_packages_unmentioned

with optional_packages_unmentioned():  # megatron-core's first import: no notices about Apex or TE
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .specs import hybrid_stack_spec


def build_hybrid_model(config, hybrid_layer_pattern: str, vocab_size: int, max_sequence_length: int,
                       stack_spec: Optional[ModuleSpec] = None, pg_collection=None, vp_stage: Optional[int] = None,
                       **kwargs) -> HybridModel:
    """A ``HybridModel`` of this package's layers, for this rank's pipeline stage.

    Args:
        config: the model's TransformerConfig; ``num_layers`` must be the pattern's layer count
            (Megatron-LM sets it so from ``--hybrid-layer-pattern``).
        hybrid_layer_pattern: ``G`` GLA (or Gated DeltaNet or KDA, by the stack spec), ``*`` softmax attention,
            ``-`` MLP, ``E`` MoE, ``|`` between pipeline segments (their number a multiple of the
            pipeline size); e.g. ``G-G*-``.
        vocab_size, max_sequence_length: as HybridModel.
        stack_spec: a :func:`megatron_zeco.specs.hybrid_stack_spec` (with its arguments); None for its defaults
            (GLA, Megatron-Core linears, ZeCO, zigzag layout).
        pg_collection: Megatron's process groups; None for ``parallel_state``'s.
        vp_stage: the virtual pipeline stage this model chunk is.
        **kwargs: HybridModel's other arguments (``position_embedding_type``, default ``none``;
            ``pre_process`` and ``post_process`` default to whether this is the first and the
            last pipeline stage).
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    main = parse_hybrid_pattern(hybrid_layer_pattern).main_pattern or ""
    layers = len(main.replace(Symbols.PIPE, ""))
    if config.num_layers != layers:
        raise ValueError(f"hybrid layer pattern {hybrid_layer_pattern!r} has {layers} layers but the config's "
                         f"num_layers (--num-layers) is {config.num_layers}; make them equal")
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    # The segment this chunk builds, as HybridModel picks it (select_pipeline_segment): segment
    # vp_stage x PP + pp_rank of the '|'-separated ones; without '|', this rank's share of the layers.
    pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
    segments = main.count(Symbols.PIPE) + 1
    index, last = ((vp_stage or 0) * pp_size + pp_rank, segments - 1) if segments > 1 else (pp_rank, pp_size - 1)
    kwargs.setdefault("pre_process", index == 0)
    kwargs.setdefault("post_process", index == last)
    kwargs.setdefault("position_embedding_type", "none")
    return HybridModel(config=config, hybrid_stack_spec=stack_spec or hybrid_stack_spec(), vocab_size=vocab_size,
                       max_sequence_length=max_sequence_length, hybrid_layer_pattern=hybrid_layer_pattern,
                       pg_collection=pg_collection, vp_stage=vp_stage, **kwargs)
