"""Megatron-Core glue: what the layers share (``common.py``), causal softmax attention under CP without
TransformerEngine (``attention.py``), GPTModel hybrids by a layer pattern (``gpt_hybrid.py``) and
HybridModel stacks (``hybrid_stack.py``, megatron-core >= 0.19). Importing its modules imports
megatron-core; importing the package alone does not.

:func:`optional_packages_unmentioned` imports megatron-core for this package's modules (``specs``,
``models``, the layers) without the notices megatron-core prints when it is first imported without
its optional packages (Apex, TransformerEngine, absl): a user of this package cannot act on them.
"""

import warnings
from contextlib import contextmanager

# megatron-core's notices about missing optional packages, printed once when its modules are first
# imported (UserWarning): (message, module), matched as warnings.filterwarnings does.
OPTIONAL_PACKAGE_NOTICES = (
    (r"Transformer Engine and Apex are not installed", r"megatron\.(core|training)\."),
    (r"Apex is not installed", r"megatron\.core\."),
    (r"absl\.logging is not installed", r"megatron\.core\.hyper_comm_grid"),
)


def hide_optional_package_notices() -> None:
    """Add filters for :data:`OPTIONAL_PACKAGE_NOTICES` (each by message and module; every other warning
    shows)."""
    for message, module in OPTIONAL_PACKAGE_NOTICES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)


@contextmanager
def optional_packages_unmentioned():
    """Within: megatron-core's notices about missing optional packages hidden. After: the warning filters as
    they were, plus those that the modules imported within added (sympy's, ...), so that code importing
    megatron-core itself still sees the notices."""
    with warnings.catch_warnings():
        hide_optional_package_notices()
        ours = list(warnings.filters)
        yield
        added = [f for f in warnings.filters if f not in ours]
    for action, message, category, module, lineno in reversed(added):  # each goes first, as when added
        warnings.filterwarnings(action, message.pattern if message else "", category, module.pattern if module else "",
                                lineno)
