import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "ds_acco_autoinstall.pth"  # DS_ACCO_INSTALL=1: ds_acco.install() when deepspeed is imported


class BuildPyWithPth(build_py):
    """Ship the top-level .pth into purelib (site-packages) of the wheel: setuptools' data_files
    would put it under the data prefix, where site never reads it."""

    def run(self):
        super().run()
        if os.path.exists(PTH):
            shutil.copy(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


class EditableWheelWithPth(editable_wheel):
    """``pip install -e`` ships the guard too: setuptools' editable wheel holds only its own path
    ``.pth`` (or finder) and never runs build_py's copy into site-packages, so the top-level .pth
    is written next to it, with the same content (it finds ds_acco through the editable finder).
    ``_select_strategy`` is setuptools' (>= 64) hook that writes the editable wheel's files."""

    def _select_strategy(self, *args, **kwargs):
        return _WithPth(super()._select_strategy(*args, **kwargs))


class _WithPth:
    """An editable strategy (a context manager called with the wheel) that adds the .pth."""

    def __init__(self, strategy):
        self._strategy = strategy

    def __enter__(self):
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self._strategy.__exit__(*exc)

    def __call__(self, wheel, files, mapping):
        self._strategy(wheel, files, mapping)
        with open(PTH, "rb") as f:
            wheel.writestr(PTH, f.read())


setup(
    name="ds_acco",
    version="0.1.0",
    description="ACCO (Accumulate While You Communicate) for DeepSpeed ZeRO-1: overlap gradient "
    "communication and the sharded optimizer step with the next micro-batches",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    # The library only: benchmarks/ (A/B runner, emulation, demo model and data), tests/, examples/ and
    # scripts/ run from a checkout and stay out of the wheel.
    packages=find_packages(include=["ds_acco", "ds_acco.*"]),
    cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
    # The ready configs ship with the package (ds_configs/ in a checkout is a link to them).
    package_data={"ds_acco.configs": ["*.json"]},
    python_requires=">=3.10",
    # The ranges are what the suite runs on: torch 2.13 (CPU; the FSDP2 adapter uses FSDP2
    # internals, see ds_acco/fsdp/_torch_internals.py), deepspeed 0.19.8. Install torch first: an
    # unpinned torch with none installed pulls a large CUDA build.
    install_requires=["torch>=2.13,<2.14", "deepspeed>=0.19.8,<0.20", "pydantic>=2"],
    extras_require={
        # Tested: transformers 5.24.0, accelerate 1.15.0, lightning 2.6.6, matplotlib 3.x. lightning 2.6
        # needs torch >= 2.1 and leaves an installed torch 2.13 in place.
        "test": ["pytest>=8", "pytest-xdist>=3.8", "transformers>=5,<6", "accelerate>=1.15", "lightning>=2.6,<2.7", "tqdm",
                 "matplotlib>=3.5", "datasets", "lion-pytorch>=0.2"],
        "hf": ["transformers>=5,<6", "accelerate>=1.15"],
        "lightning": ["lightning>=2.6,<2.7"],
        "examples": ["transformers>=5,<6", "accelerate>=1.15", "tqdm", "datasets"],
        "bench": ["matplotlib>=3.5", "transformers>=5,<6", "tqdm"],  # for a checkout's python -m benchmarks
        "mpi": ["mpi4py", "mpich"],
    },
)
