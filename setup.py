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
]

EXTRAS = {
    "dev": [
        "pytest==9.2.0",
        "pytest-timeout==2.4.0",
        "ruff==0.17.5",
        "matplotlib==3.11.2",
    ],
    "ray": ["ray==2.60.0"],
    "maxtext": ["maxtext==0.2.5"],
    "tpu": ["jax[tpu]==0.12.0.1"],
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
    },
)
