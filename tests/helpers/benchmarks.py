"""A script of ``benchmarks/`` as a module, importing its siblings as the script does."""

import importlib.util
import os
import sys
from unittest import mock

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def load(name: str):
    """``benchmarks/<name>.py`` loaded as the module ``name``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    with mock.patch.object(sys, "path", [BENCHMARKS, *sys.path]):
        spec.loader.exec_module(module)
    return module
