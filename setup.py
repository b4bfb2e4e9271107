"""rljax: reinforcement learning for language models, in JAX."""

import setuptools

# Lower bounds are the versions the suite was run with; the upper bounds only
# exist where a newer release is known to break us.
INSTALL_REQUIRES = [
    "jax>=0.6.0",
    "jaxlib>=0.6.0",
    "flax>=0.11.0",
    "optax>=0.2.4",
    "orbax-checkpoint>=0.11.0",
    "chex>=0.1.89",
    "ml-collections>=1.0.0",
    "absl-py>=2.1.0",
    "numpy>=1.26",
    # Weights and tokenizers of real models.
    "gguf>=0.16.0",
    "tokenizers>=0.21.0",
    "safetensors>=0.4.5",
    "jinja2>=3.1",
    # Run directories: progress, TensorBoard events, plots.
    "tqdm>=4.66",
    "tensorboardX>=2.6",
    "matplotlib>=3.8",
]

EXTRAS = {
    "test": [
        "pytest>=8.0",
        "pytest-xdist>=3.5",
        "hypothesis>=6.100",
        # Parity tests against the reference implementation; 2.13.0 is the
        # CPU build that ships with the CI image (no multi-GB CUDA download).
        "torch==2.13.0",
        "transformers>=4.50",
        "nbclient>=0.10",
        "ipykernel>=6.29",
        "nbformat>=5.10",
        "fastapi>=0.115",
        "uvicorn>=0.30",
        "httpx>=0.27",
        "openai>=3.57",
        # The dataset and reasoning_gym tasks (same list as "data" below).
        "datasets>=5.2.0",
        "math-verify>=0.9.0",
        "google-re2>=1.1",
        "reasoning-gym>=0.1.25",
    ],
    "notebooks": ["jupyter>=1.0", "nbclient>=0.10", "ipykernel>=6.29"],
    "serve": ["fastapi>=0.115", "uvicorn>=0.30", "httpx>=0.27", "openai>=3.57"],
    # Your own data (the dataset task: HF datasets, math-verify, RE2) and
    # reasoning-gym's generators. An extra, not core: they pull in pyarrow,
    # pandas, sympy and reasoning-gym's many puzzle libraries, which the
    # trainer and the built-in tasks never need.
    "data": ["datasets>=5.2.0", "math-verify>=0.9.0", "google-re2>=1.1",
             "reasoning-gym>=0.1.25"],
}

setuptools.setup(
    name="rljax",
    version="0.1.0",
    description="Reinforcement learning for language models in JAX: every "
    "policy-gradient recipe as one setting of five axes.",
    packages=setuptools.find_packages(include=["rljax", "rljax.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["rljax=rljax.cli:main"]},
)
