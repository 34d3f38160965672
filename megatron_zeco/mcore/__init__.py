"""Megatron-Core glue: what the layers share (``common.py``), causal softmax attention under CP without
TransformerEngine (``attention.py``), GPTModel hybrids by a layer pattern (``gpt_hybrid.py``) and
HybridModel stacks (``hybrid_stack.py``, megatron-core >= 0.19). Importing it imports megatron-core."""
