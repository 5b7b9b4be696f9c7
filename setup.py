"""dflash-dist: distributed training of DFlash speculative-decoding drafters."""

from setuptools import find_packages, setup

# Pinned so a fresh CPU machine resolves the set checked in ../shared/PLATFORM.md.
# torch==2.13.0 resolves to the CPU build these machines carry on disk (PLATFORM.md); elsewhere PyPI's 2.13.0 is
# a CUDA build (several GB, also runs on a CPU): install the CPU wheel first where that matters.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "transformers==5.24.0",
    "flash-linear-attention==0.6.0",
    "fla-core==0.6.0",
    "deepspeed==0.19.8",
    "ray[default]==2.60.0",
    "webdataset==1.0.2",
    "pyarrow==26.0.1",  # Parquet conversation sources
    "datasets==5.2.0",  # conversation sources saved with `Dataset.save_to_disk`
    "tensorboard==2.21.0",
    "openai==3.57.0",  # `dflash-dist regenerate` against an OpenAI-compatible server (SGLang, vLLM)
    "xxhash==4.1.0",  # shard member and checkpoint file checksums (data_pipeline/checksums.py)
    "pydantic==2.14.4",  # the typed config (dflash_dist/config.py)
    "typing_extensions==4.16.0",  # pydantic 2.14 needs >= 4.16 (`import pydantic` fails on 4.12)
    "rich==15.0.0",  # `dflash-dist status` tables (launcher/status.py)
    "psutil==7.2.2",  # the network interface holding an address (dflash_dist/node_address.py)
    "safetensors",
    "numpy",
    "pyyaml",
    "tqdm",
]

TEST_REQUIRES = [
    "pytest==9.2.0",
    "ruff",
]

BENCH_REQUIRES = [
    "matplotlib==3.11.2",  # bench/bench_quality.py's tau-vs-samples plot
]

# GPU machines only (needs Triton, which CPU environments must not install: ../shared/PLATFORM.md):
# the drafter's `train.kernels: liger` set (dflash_dist/model/fused.py); without it "auto" uses torch.compile.
# Triton itself (dflash_dist/model/ce_kernel.py) comes with liger-kernel and with torch's CUDA wheels.
GPU_REQUIRES = [
    "liger-kernel==0.8.5",
]

setup(
    name="dflash-dist",
    version="0.1.0",
    description="Distributed training of DFlash block-diffusion drafters for speculative decoding",
    python_requires=">=3.10",
    packages=find_packages(include=["dflash_dist*", "data_pipeline*", "launcher*"]),
    package_data={"": ["*.yaml"]},
    install_requires=INSTALL_REQUIRES,
    extras_require={"test": TEST_REQUIRES, "bench": BENCH_REQUIRES, "gpu": GPU_REQUIRES},
    entry_points={"console_scripts": ["dflash-dist=launcher.cli:main"]},
)
