"""``python -m megatron_zeco.cost_model``: the projected time of one layer per strategy (``--help``)."""

from . import main

main()
