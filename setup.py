"""tunix_mcjax: multi-controller JAX runtime for GRPO post-training with Tunix and MaxText."""

from setuptools import find_packages, setup

CORE = [
    "jax[cpu]==0.12.0.1",
    "flax==0.12.12",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "google-tunix==0.1.7",
    "numpy==2.5.5",
    "pyyaml==6.0.4",
    "tokenizers==0.22.2",
    "transformers==5.12.1",
    "safetensors==0.7.0",
    "etils[epath]==1.15.0",  # run paths (gs:// too), as MaxText and Orbax use them
    "tensorboardX==2.6.5",  # enable_tensorboard's scalars, as MaxText writes them
    "ray==2.60.0",  # rl_runtime=mcjax_da: trainer and rollout actors on a Ray cluster
]

EXTRAS = {
    "dev": [
        "pytest==9.2.0",
        "pytest-timeout==2.4.0",
        "pytest-xdist==3.8.0",  # make test: the suite on every core
        "ruff==0.17.5",
        "matplotlib==3.11.2",
        "psutil==7.2.2",
    ],
    # MaxText's RL path on CPU, without vllm/tpu-inference/torch; make setup patches it.
    "maxtext": [
        "maxtext==0.2.5",
        "pathwaysutils==0.1.13",
        "drjax==0.2.1",
        "aqtp==0.9.0",
        "tokamax==0.0.17",
        "tiktoken==0.14.0",
        "math-verify==0.9.0",
    ],
    "tpu": ["jax[tpu]==0.12.0.1"],
    # NVIDIA GPUs: JAX's CUDA 12 plugin at the pinned jax (pip install -e '.[gpu]').
    "gpu": ["jax[cuda12]==0.12.0.1"],
    # The documentation site (make docs builds it in .venv-docs from constraints-docs.txt).
    "docs": ["sphinx==9.1.1", "myst-parser==5.2.0", "sphinx-book-theme==1.4.0"],
}

setup(
    name="tunix_mcjax",
    version="0.1.0",
    description=__doc__,
    license="Apache-2.0",
    python_requires=">=3.12",
    packages=find_packages(include=["tunix_mcjax", "tunix_mcjax.*"]),
    package_data={"tunix_mcjax": ["data/*"]},
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": ["tunix-mcjax=tunix_mcjax.launch:main"],
        "maxtext.rl_runtimes": ["mcjax = tunix_mcjax.maxtext:main"],
        "tunix.rl_runtimes": ["mcjax = tunix_mcjax.tunix:main"],
    },
)
