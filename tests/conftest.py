"""Shared fixtures: 8 fake CPU devices, one prepared corpus, a tiny config."""
import os
import tempfile


def xla_flags(devices: int) -> str:
  """`devices` fake CPU devices, whose code compiles fast rather than runs fast.

  Compiling, not running, is most of a tiny test's time. LLVM unoptimized halves the nano train
  step's compile, with the same losses to the bit; XLA CPU's older loop emitters instead of its
  MLIR fusion emitters halve it again (2.26 s, 1.18 s with both).
  """
  return (f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0 "
          "--xla_cpu_use_fusion_emitters=false")


import pathlib
# Imported now, not by pytest's unraisable-exception hook: should a finalizer raise while
# tensorflow_datasets holds etils' lazy-import context open, the hook's own `import tracemalloc`
# would run inside it, fail, and fail the test that happened to be running.
import tracemalloc  # pylint: disable=unused-import

import pytest

TPU_TIER_REASON = "the TPU tier: `pytest -m tpu` on a machine with a TPU chip (getting-started.md)"


def selects_tpu_tier(markexpr: str) -> bool:
  """Whether `-m markexpr` selects tests marked tpu and no others (`-m tpu`, `-m "tpu and not
  slow"`, not `-m "slow or tpu"`), by pytest's own reading of the expression."""
  from _pytest.mark.expression import Expression  # pylint: disable=g-import-not-at-top
  if not markexpr:
    return False
  expression = Expression.compile(markexpr)
  marked = lambda *names: expression.evaluate(lambda name, **_: name in names)
  return marked("tpu") and not marked() and not marked("slow")


def pytest_configure(config):
  """The devices a session runs on, set before anything imports jax (test modules are imported
  after this hook; this file imports no jax).

  Every session but the TPU tier's runs on 8 fake CPU devices, which compile fast rather than
  run fast, and so do the subprocesses it starts. The tier leaves the platform to JAX: the
  chip, and the host's CPU beside it for references. One persistent compilation cache serves
  a session and its subprocesses: many tests compile the same tiny steps, each in well under
  JAX's 1 s threshold for caching. (A test of the cache itself sets its own.)
  """
  if not selects_tpu_tier(config.getoption("markexpr") or ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags(8)}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        tempfile.mkdtemp(prefix="levanter_flax-tests-jax-cache-"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_collection_modifyitems(config, items):
  """Tests marked tpu run in the TPU tier, on a chip; anywhere else they are skipped, saying why."""
  tier = [item for item in items if item.get_closest_marker("tpu")]
  if not tier:
    return
  on_chip = False
  if selects_tpu_tier(config.getoption("markexpr") or ""):
    import jax  # pylint: disable=g-import-not-at-top  # Only once the platform is settled.
    try:
      on_chip = jax.default_backend() == "tpu"
    except RuntimeError as e:  # Another process holds the chip, say.
      raise pytest.UsageError(f"the TPU tier cannot open the chip: {e}") from None
  if not on_chip:
    skip = pytest.mark.skip(reason=f"needs a TPU chip: {TPU_TIER_REASON}")
    for item in tier:
      item.add_marker(skip)

REPO = pathlib.Path(__file__).resolve().parent.parent
# Families with no layer code of their own: Qwen3-MoE's layers are Qwen3's attention and
# Mixtral's mixture block. Tests of what each family's layers compute (meshes, scanning, FLOPs,
# document masking) run those two; HF interop and configs run every family.
COMPOSED_FAMILIES = frozenset({"qwen3_moe"})
def deepseek_sizes() -> dict:
  """A tiny DeepSeek-V3's own settings, beside the sizes tests give every family: latent
  attention (a key/value head per query head, keys and values of their own widths), one dense
  layer, then mixtures of 8 experts in 4 groups (2 per token from 2 groups) with a shared expert.
  """
  from levanter_flax.models.moe import MoeConfig  # pylint: disable=g-import-not-at-top
  return dict(
      num_kv_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
      v_head_dim=12, first_dense_layers=1,
      moe=MoeConfig(num_experts=8, num_experts_per_token=2, scoring="sigmoid", num_groups=4,
                    top_groups=2, expert_dim=32, num_shared_experts=1, bias_update_rate=0.001))


def parent_pid(pid: int) -> int:
  """From /proc/<pid>/stat; the name in parentheses may hold spaces. OSError: gone."""
  return int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def load_config_file(name: str):
  """What --config=configs/FILE.py[:VARIANT] reads, for a name FILE[:VARIANT] (gpt2_nano,
  gpt2:nano)."""
  from levanter_flax import config
  file, *variant = name.split(":", 1)
  return config.load_config_file(":".join([str(REPO / "configs" / f"{file}.py"), *variant]))


def config_variants() -> dict[str, list[str]]:
  """FILE -> its variants, for each configs/FILE.py of several (its VARIANTS)."""
  import importlib.util
  found = {}
  for path in sorted((REPO / "configs").glob("*.py")):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "VARIANTS"):
      found[path.stem] = list(module.VARIANTS)
  return found


def shipped_configs() -> list[str]:
  """Every config configs/ ships, once, as load_config_file names it: FILE:VARIANT for each
  variant of a file of several, FILE for a file of one. Not the variants' earlier names
  (gpt2_nano, which is gpt2:nano)."""
  variants = config_variants()
  named = [f"{file}:{variant}" for file, names in variants.items() for variant in names]
  earlier = {name.replace(":", "_") for name in named}
  return sorted(named + [path.stem for path in (REPO / "configs").glob("*.py")
                         if path.stem not in variants and path.stem not in earlier])


@pytest.fixture(scope="session", autouse=True)
def forkserver_environment():
  """The environment a forked command starts from: the session's, before any test patches it
  (test modules that set a variable at import have done so by now)."""
  import forkserver
  forkserver.record_session_environment()


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> pathlib.Path:
  """A cache dir with the built-in corpus tokenized once for the whole session."""
  from levanter_flax.config import default_config
  from levanter_flax.data import dataset_writer
  cache_dir = tmp_path_factory.mktemp("data_cache")
  data = default_config().data
  dataset_writer.builtin_dataset(str(cache_dir), data.tokenizer, data.validation_fraction,
                                 data.num_train_shards)
  return cache_dir


@pytest.fixture
def tiny_config(data_cache):
  return make_tiny_config(data_cache)


def make_tiny_config(data_cache: pathlib.Path):
  """gpt2_nano shrunk further so a step takes milliseconds on 8 fake devices."""
  config = load_config_file("gpt2_nano")
  config.model.seq_len = 64
  config.model.num_layers = 2
  config.model.hidden_dim = 64
  config.trainer.batch_size = 8
  config.trainer.num_train_steps = 10
  config.trainer.log_every_steps = 1
  config.trainer.eval_every_steps = 5
  config.trainer.eval_tokens = 1024
  config.checkpoint.every_steps = 5
  config.optimizer.warmup_steps = 2
  config.data.cache_dir = str(data_cache)
  # One reader group: each of the default 8 builds and traces its own pipeline and decodes its
  # own shard before the first batch. Tests of the default set it back to 0.
  config.data.reader_groups = 1
  return config


@pytest.fixture(scope="session")
def two_steps(data_cache, tmp_path_factory) -> pathlib.Path:
  """tiny_config's run stopped after 2 steps, its checkpoint at 2: what the tests that change a
  setting or damage a file take up, each in a copy (taken_up)."""
  from levanter_flax.config import to_run_config
  from levanter_flax.training.loop import train_and_evaluate
  config = make_tiny_config(data_cache)
  config.trainer.num_train_steps = 2
  workdir = tmp_path_factory.mktemp("two_steps") / "run"
  train_and_evaluate(to_run_config(config), workdir)
  return workdir


def taken_up(run: pathlib.Path, workdir: pathlib.Path) -> pathlib.Path:
  """A copy of `run` in `workdir` (which may exist, empty)."""
  import shutil
  shutil.copytree(run, workdir, dirs_exist_ok=True)
  return workdir


def read_metrics(workdir: pathlib.Path) -> list[dict]:
  import json
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def train_losses(workdir: pathlib.Path) -> dict[int, float]:
  return {m["step"]: m["train/loss"] for m in read_metrics(workdir) if "train/loss" in m}


def as_at_checkpoint(workdir: pathlib.Path, copy: pathlib.Path, step: int) -> pathlib.Path:
  """A copy of a finished run's workdir as it was when its step-`step` checkpoint was the newest:
  a run that stopped there, for a resume to take up, at no cost of training it again."""
  import json
  import shutil
  taken_up(workdir, copy)
  for checkpoint in (copy / "checkpoints").iterdir():
    if int(checkpoint.name) > step:
      shutil.rmtree(checkpoint)
  metrics = copy / "metrics.jsonl"
  metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                             if json.loads(line)["step"] <= step))
  return copy


def random_documents(count: int, seed: int = 0) -> list[str]:
  """Distinct documents of varied lengths, some non-ASCII, so windows never repeat."""
  import numpy as np
  rng = np.random.default_rng(seed)
  alphabet = list("abcdefghijklmnopqrstuvwxyz ,.\néü✓")
  return [f"doc{seed}-{i}: " + "".join(rng.choice(alphabet, size=rng.integers(20, 400)))
          for i in range(count)]


def prepare_texts(directory: pathlib.Path, texts: list[str], **options) -> pathlib.Path:
  """Writes one file per text under directory/input and prepares them into directory/data."""
  from levanter_flax.data import dataset_writer, sources
  inputs = directory / "input"
  inputs.mkdir(parents=True, exist_ok=True)
  for i, text in enumerate(texts):
    (inputs / f"{i:04d}.txt").write_text(text, encoding="utf-8")
  source = sources.SourceSpec(kind="text", inputs=(str(inputs / "*.txt"),))
  options = {"num_shards": 4, "validation_fraction": 0.2, **options}
  return dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
      source=source, output_dir=directory / "data", **options))


def write_dataset(directory: pathlib.Path, train: list[str], validation: list[str],
                  num_shards: int = 1) -> pathlib.Path:
  """A byte-tokenized dataset whose validation stream is `validation` in this order: document i
  goes to shard i * num_shards // len, so shards hold consecutive documents."""
  import dataclasses
  import json
  from levanter_flax.data import tfrecord
  from levanter_flax.data.manifest import FORMAT_VERSION, MANIFEST
  from levanter_flax.data.tokenizers import ByteTokenizer, identity
  directory.mkdir(parents=True)
  tokenizer = ByteTokenizer()
  splits = {}
  for split, texts in (("train", train), ("validation", validation)):
    splits[split] = []
    for shard in range(num_shards):
      mine = [t for i, t in enumerate(texts) if i * num_shards // len(texts) == shard]
      path = directory / f"{split}-{shard}.tfrecord"
      with tfrecord.ShardWriter(path, "uint16") as writer:
        for text in mine:
          writer.write(tokenizer.encode(text))
      splits[split].append({"file": path.name, "num_documents": writer.num_documents,
                            "num_tokens": writer.num_tokens,
                            "num_text_bytes": sum(len(t.encode()) for t in mine),
                            "tokens_crc32c": writer.tokens_crc32c})
  manifest = {"format_version": FORMAT_VERSION,
              "tokenizer": dataclasses.asdict(identity(tokenizer)), "token_dtype": "uint16",
              "source": {"kind": "text"}, "splits": splits}
  (directory / MANIFEST).write_text(json.dumps(manifest))
  return directory
