from setuptools import find_packages, setup

setup(
    name="ds_acco",
    version="0.1.0",
    description="ACCO (Accumulate While You Communicate) for DeepSpeed ZeRO-1: overlap gradient "
    "communication and the sharded optimizer step with the next micro-batches",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_acco", "ds_acco.*"]),
    # The ready configs ship with the package (ds_configs/ in a checkout is a link to them).
    package_data={"ds_acco.configs": ["*.json"]},
    python_requires=">=3.10",
    # The ranges are what the suite runs on: torch 2.13 (CPU; the FSDP2 adapter uses FSDP2
    # internals, see ds_acco/fsdp/_torch_internals.py), deepspeed 0.19.8. Install torch first: an
    # unpinned torch with none installed pulls a large CUDA build.
    install_requires=["torch>=2.13,<2.14", "deepspeed>=0.19.8,<0.20", "pydantic>=2"],
    extras_require={
        # Tested: transformers 5.24.0, accelerate 1.15.0, matplotlib 3.x.
        "test": ["pytest>=8", "transformers>=5,<6", "accelerate>=1.15", "tqdm", "matplotlib>=3.5", "datasets"],
        "hf": ["transformers>=5,<6", "accelerate>=1.15"],
        "examples": ["transformers>=5,<6", "accelerate>=1.15", "tqdm", "datasets"],
        "bench": ["matplotlib>=3.5", "transformers>=5,<6", "tqdm"],
        "mpi": ["mpi4py", "mpich"],
    },
)
