"""An autotuned Triton kernel for the tests of megatron_zeco/common/tuning.py, run through Triton's
interpreter, with the autotuner's timing replaced by a preference order (no GPU to time on).

``python -m tests.helpers.tuned_kernel MODE DIRECTORY PREFER N...`` runs ``scale`` on inputs of each length
``N`` in a fresh interpreter: MODE ``record`` shares tuning through ``DIRECTORY`` (a recording run's
process), ``replay`` replays the record at ``DIRECTORY``, ``untuned`` runs the first config (DIRECTORY unused; ``untuned-compiler-fails:16,32``:
the compiler failing on those BLOCKs, ``untuned-error:16``: another error there); the configs the autotuner timed and the ones it
ran are printed as JSON, the last line.
"""

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((16, 1), (32, 2), (64, 4))]


@triton.autotune(configs=CONFIGS, key=["N"])
@triton.jit
def scale_kernel(x, y, N, factor, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    tl.store(y + o, tl.load(x + o, mask=m) * factor, mask=m)


def scale(x, factor):
    y = torch.empty_like(x)
    scale_kernel[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, y, x.numel(), factor)
    return y


def main(mode, directory, prefer, *lengths):
    """Run ``scale`` at each length; the autotuner's timing ranks config ``prefer`` fastest."""
    from megatron_zeco.common import tuning

    timed, ran = [], []
    tuner = tuning._autotuner(scale_kernel)

    def bench(*args, config, **kw):
        timed.append(config.kwargs["BLOCK"])
        return [0.0 if config.kwargs["BLOCK"] == int(prefer) else 1.0] * 3

    tuner._bench = bench
    if mode == "record":
        tuning._share_autotuning(tuning.SharedRecord(directory))
    elif mode.startswith("untuned"):
        tuning._take_first_config()
        if ":" in mode:  # untuned-<what>:BLOCK,...: those configs fail, the compiler (as Triton says) or otherwise
            what, blocks = mode.split(":")
            failing_blocks = {int(b) for b in blocks.split(",")}
            message = "PassManager::run failed" if what == "untuned-compiler-fails" else "some other error"
            run = tuner.fn.run

            def failing(*args, **kw):
                if kw.get("BLOCK") in failing_blocks:
                    raise RuntimeError(message)
                return run(*args, **kw)

            tuner.fn.run = failing
    else:
        tuning.replay(tuning._load(directory))
    for n in map(int, lengths):
        x = torch.randn(n)
        assert torch.equal(scale(x, 3.0), x * 3.0)
        ran.append(tuner.best_config.kwargs["BLOCK"])
    keys = [list(k) for k in tuner.cache]
    print(json.dumps({"timed": timed, "ran": ran, "keys": keys}))


if __name__ == "__main__":  # by its module's name, so that the kernel is named as imported elsewhere
    from tests.helpers.tuned_kernel import main as run

    run(*sys.argv[1:])
