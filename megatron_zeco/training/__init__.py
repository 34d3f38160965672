"""The main job (``python -m megatron_zeco.train``), laid out as Megatron-LM lays out its training:
``arguments`` (flags and their checks), ``initialize`` (process groups), ``model``, ``training`` (the
loop) and ``checkpointing`` (save and resume). ``megatron_zeco/train.py`` is the command."""
