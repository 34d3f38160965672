"""megatron_zeco: ZeCO context parallelism for linear attention in Megatron-Core."""

from setuptools import find_packages, setup

setup(
    name="megatron_zeco",
    version="0.1.0",
    description="ZeCO (All-Scan) context parallelism for linear attention (GLA, Gated DeltaNet, KDA) in Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_zeco", "megatron_zeco.*"]),
    # the cost model's calibration: copies of the result files in docs/results that it reads
    package_data={"megatron_zeco.cost_model": ["data/*.json"], "megatron_zeco.common": ["configs/*.json"]},
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16",
        # megatron-core's checkpoint writer needs it; without it a save hangs (0.16.1).
        "psutil",
    ],
    extras_require={
        # CPU test suite (Triton kernels run there under TRITON_INTERPRET=1), with the Triton whose interpreter
        # the suite is checked against (docs/testing.md: no release's interpreter multiplies bf16 tiles right).
        "test": ["pytest>=8", "pytest-timeout", "hypothesis", "triton==3.9.0"],
        # GPU speed: fla's kernels (this release: the GPU paths call its internal functions, pinned as
        # megatron_zeco.common.backend.FLA_VERSION) and our Triton kernels. Imported lazily.
        "gpu": ["triton", "fla-core==0.6.0"],
    },
)
