"""Local pieces every operator shares: the choice of kernels or PyTorch forms (``backend.py``), chunking and packed
segments of the PyTorch forms (``chunked.py``), the short causal convolution (``conv.py``), the gated output
norm (``norm.py``), the chunked delta rule's passes over the chunks (``delta.py``), a ZeCO piece from a local op
or from an operator's chunked forms (``piece.py``)."""
