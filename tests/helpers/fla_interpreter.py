"""flash-linear-attention's Triton kernels on the CPU, under Triton's interpreter: this package's fla paths
(the CUDA pieces of the delta rules) tested against fla's real kernels without a GPU.

Two gaps of the interpreter are bridged, for this process only:

* its loop counters (``for i_t in range(NT)``) are Python ints, which fla's kernels convert with
  ``i_t.to(tl.int64)``: the interpreter's own rewriting of each kernel's source (``FunctionRewriter``) also
  turns every ``x.to(...)`` into a call that first makes a Python int a tensor;
* Triton's autotuner times its configs on a GPU: here every config times alike, so each kernel runs its
  first config (the results do not depend on the config).

fla-core 0.6.0 imports on a CPU-only host under ``TRITON_INTERPRET=1`` (it needs ``einops``); it runs in
float32 (the interpreter's 16-bit products are wrong, as for this package's kernels).
"""

import ast
import importlib.util
import os

import torch


def available() -> str:
    """Why fla's kernels cannot run here under the interpreter, or "" if they can."""
    if torch.cuda.is_available():
        return "CUDA is available: the GPU tests run fla's kernels on it"
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return "needs TRITON_INTERPRET=1"
    for name in ("fla", "einops"):
        if importlib.util.find_spec(name) is None:
            return f"needs {name} importable (fla-core 0.6.0 and einops on the path)"
    return ""


def _int_then_to(x, *args, **kwargs):
    """``x.to(...)``, with a Python int (the interpreter's loop counter) made a tensor first."""
    from triton.runtime import interpreter

    if isinstance(x, int):
        x = interpreter.interpreter_semantic.to_tensor(x, False)
    return x.to(*args, **kwargs)


def enable() -> None:
    """Bridge the two gaps (module docstring); idempotent."""
    from triton.runtime import autotuner, interpreter

    if getattr(interpreter.FunctionRewriter.ast_transformer, "counts_loops", False):
        return

    class Transformer(interpreter.ASTTransformer):
        counts_loops = True

        def visit_Call(self, node):
            node = self.generic_visit(node)
            if isinstance(node.func, ast.Attribute) and node.func.attr == "to":
                return ast.copy_location(ast.Call(func=ast.Name(id="_int_then_to", ctx=ast.Load()),
                                                  args=[node.func.value, *node.args], keywords=node.keywords), node)
            return node

    interpreter._int_then_to = _int_then_to  # the rewritten kernels find the interpreter's names in their globals
    interpreter.FunctionRewriter.ast_transformer = Transformer()
    interpreter.InterpretedFunction.rewritten_fn.clear()
    autotuner.Autotuner.do_bench = property(
        lambda self: lambda fn, quantiles=None, **kw: [0.0] * (len(quantiles) if quantiles else 1))
