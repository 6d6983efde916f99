"""Config files load and validate; bad keys and types are refused by name."""
import re

import ml_collections
import pytest

from conftest import REPO, config_variants, load_config_file, shipped_configs
from levanter_flax.config import (SHIPPED_CONFIGS, default_config, find_config_file,
                                  load_config_file as load_config, load_preset, mesh, run_name,
                                  shipped_names, to_run_config)
from levanter_flax.core.errors import UserError

SHIPPED = shipped_configs()
VARIANTS = [f"{file}:{variant}" for file, names in config_variants().items() for variant in names]
# The variants that had files of their own before files took variants.
EARLIER = ["gpt2:nano", "gpt2:small", "gpt2:small_fast", "gpt2:medium", "llama:nano", "llama:1b",
           "llama:7b", "qwen2:nano", "qwen2:0_5b", "mistral:nano", "mistral:7b", "mixtral:nano",
           "mixtral:8x7b"]
# Each file of variants' choice when --config names none, as its docstring says.
DEFAULT_VARIANTS = {"gpt2": "small", "llama": "1b", "qwen2": "0_5b", "mistral": "7b",
                    "mixtral": "8x7b", "qwen3": "0_6b", "qwen3_moe": "30b_a3b", "olmo2": "1b", "gemma3": "1b",
                    "deepseek_v3": "671b"}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_validate(name):
  run = to_run_config(load_config_file(name))
  assert run.trainer.batch_size > 0


def test_required_configs_exist():
  assert {*EARLIER, "qwen2:0_5b_sft", "qwen2:0_5b_dpo", "llama:1b_lora", "shakespeare_char", "nanogpt_cpu"} <= set(
      SHIPPED)


@pytest.mark.parametrize("name", EARLIER)
def test_each_variant_is_also_its_earlier_file(name):
  """configs/gpt2_nano.py, which users' scripts name, is one line naming configs/gpt2.py:nano."""
  file, variant = name.split(":")
  earlier = REPO / "configs" / f"{file}_{variant}.py"
  assert f'variant_file(__file__, "{file}.py", "{variant}")' in earlier.read_text()
  config, earlier_config = load_config_file(name), load_config_file(earlier.stem)
  assert to_run_config(earlier_config) == to_run_config(config)
  assert earlier_config.to_dict() == config.to_dict()


@pytest.mark.parametrize("file, default", DEFAULT_VARIANTS.items())
def test_a_file_of_variants_without_one_is_its_documented_default(file, default):
  assert set(DEFAULT_VARIANTS) == set(config_variants())
  assert f"{default} when none is given" in (REPO / "configs" / f"{file}.py").read_text()
  chosen = load_config_file(f"{file}:{default}")
  assert to_run_config(load_config_file(file)) == to_run_config(chosen)


@pytest.mark.parametrize("argument, message", [
    ("configs/gpt2.py:x", "config file configs/gpt2.py: unknown variant 'x'; choose one of nano, "
                          "small, medium, small_fast"),
    ("configs/llama.py:", "config file configs/llama.py: unknown variant ''; choose one of nano, "
                          "1b, 7b, 70b, 1b_lora"),
    ("configs/gpt2_nano.py:small", "config file configs/gpt2_nano.py is gpt2.py:nano and takes no "
                                   "variant; got 'small' (for a variant of gpt2.py: "
                                   "--config=configs/gpt2.py:small)"),
])
def test_a_bad_variant_is_one_line_naming_the_choices(monkeypatch, argument, message):
  monkeypatch.chdir(REPO)
  with pytest.raises(UserError) as raised:
    load_config(argument)
  assert str(raised.value) == message


def test_config_files_find_each_other_wherever_the_command_runs(tmp_path, monkeypatch):
  """mixtral_8x7b.py names mixtral.py:8x7b, which is mistral.py:7b's run: each beside the other,
  not in the working directory."""
  monkeypatch.chdir(tmp_path)
  config = load_config(f"{REPO}/configs/mixtral_8x7b.py")
  assert (config.model.architecture, config.trainer.num_train_steps) == ("mixtral", 2000)


@pytest.mark.parametrize("argument, name", [
    ("configs/gpt2.py:nano", "gpt2_nano"), ("configs/gpt2_nano.py", "gpt2_nano"),
    ("/abs/configs/llama.py", "llama"), ("qwen2.py:0_5b", "qwen2_0_5b"),
    ("gpt2_nano", "gpt2_nano"), ("gpt2:nano", "gpt2_nano"), ("llama", "llama"),
])
def test_the_default_workdir_is_named_after_the_file_and_its_variant(argument, name):
  assert run_name(argument) == name


def test_every_config_the_docs_name_loads():
  """Where the docs list configs they name files of variants by FILE:VARIANT; the earlier
  names they still name (configs/gpt2_nano.py) load too."""
  docs = [REPO / "README.md", REPO / "BUILD_NOTES.md", *(REPO / "docs").glob("*.md"),
          *(p for p in (REPO / "launch").rglob("*") if p.is_file()),
          *(REPO / "configs").glob("*.py")]
  named = {name for doc in docs
           for name in re.findall(r"configs/[\w/]+\.py(?::[a-z0-9_]+)?", doc.read_text())}
  assert {f"configs/{name.replace(':', '.py:')}" for name in VARIANTS} <= named
  for name in sorted(named):
    load_config(str(REPO / name))


def test_gpt2_small_shape():
  model = to_run_config(load_config_file("gpt2:small")).model
  assert (model.num_layers, model.num_heads, model.hidden_dim, model.seq_len) == (12, 12, 768, 1024)


def test_device_mesh_keeps_axis_order():
  config = default_config()
  config.trainer.device_mesh = mesh(model=2, data=-1)
  assert to_run_config(config).trainer.device_mesh == (("model", 2), ("data", -1))


def test_axes_accept_names_and_comma_lists():
  config = default_config()
  config.sharding.parameter_axis = "data"
  config.sharding.optimizer_axis = "data,model"
  sharding = to_run_config(config).sharding
  assert sharding.parameter_axis == "data"
  assert sharding.optimizer_axis == ("data", "model")
  assert sharding.activation_axis == "data"


@pytest.mark.parametrize("section, key, value, message", [
    ("trainer", "batch_sise", 8, "unknown config key config.trainer.batch_sise"),
    ("trainer", "eval_batches", 8, "config key config.trainer.eval_batches was replaced: set "
                                   "config.trainer.eval_tokens"),
    ("model", "num_layers", 0, "config.model.num_layers must be positive"),
    ("model", "num_heads", 5, "config.model.hidden_dim (768) must be divisible by config.model.num_heads (5)"),
    ("model", "dtype", "float8", "config.model.compute.dtype"),
    ("data", "validation_fraction", 1.5, "config.data.validation_fraction"),
    ("data", "on_corrupt_record", "ignore", "config.data.on_corrupt_record must be 'fail' or 'skip'"),
    ("model", "remat", "some", "config key config.model.compute.remat must be True, False or one of none, full,"),
    ("model", "attention_impl", "flash", "config.model.compute.attention_impl must be one of auto, xla, cudnn"),
    ("model", "param_dtype", "int8", "config.model.compute.param_dtype must be float32, bfloat16 or float16"),
    ("trainer", "gradient_accumulation_steps", 5,
     "config.trainer.batch_size (32) must be divisible by config.trainer.gradient_accumulation_steps (5)"),
    ("data", "mixture", {"web": {"dataset": "/d", "weight": 0}},
     "config key config.data.mixture.web must be dict(dataset=<directory>, weight=<positive number>)"),
    ("data", "mixture", {"web": {"path": "/d", "weight": 1}}, "config key config.data.mixture.web"),
    ("model", "architecture", "mamba", "config.model.architecture must be one of gpt2, llama, "),
    ("model", "num_kv_heads", 4, "unknown config key config.model.num_kv_heads"),
    ("optimizer", "name", "sgd", "config.optimizer.name must be one of adamw, lion, adafactor, sophia_h, muon; got 'sgd'"),
    ("optimizer", "schedule", "step", "config.optimizer.schedule must be one of cosine, wsd, linear, constant; got 'step'"),
    ("optimizer", "decay_fraction", 0.0, "config.optimizer.decay_fraction must be in (0, 1]; got 0.0"),
    ("optimizer", "decay_fraction", 1.5, "config.optimizer.decay_fraction must be in (0, 1]; got 1.5"),
    ("optimizer", "decay_shape", "cosine", "config.optimizer.decay_shape must be one of linear, sqrt; got 'cosine'"),
    ("optimizer", "muon_ns_steps", 0, "config.optimizer.muon_ns_steps must be >= 1; got 0"),
    ("trainer", "hang_watchdog_seconds", -1.0, "config.monitoring.hang_watchdog_seconds must be >= 0 (0: off)"),
    ("trainer", "profiler_num_steps", 0, "config key config.monitoring.profiler_num_steps must be positive"),
    ("trainer", "max_consecutive_skipped_steps", 0,
     "config key config.trainer.max_consecutive_skipped_steps must be positive"),
    ("optimizer", "learning_rate", -1e-3, "config.optimizer.learning_rate must be > 0; got -0.001"),
    ("optimizer", "warmup_steps", -5, "config.optimizer.warmup_steps must be >= 0; got -5"),
    ("optimizer", "hessian_update_interval", 0, "config.optimizer.hessian_update_interval must be >= 1"),
    ("optimizer", "beta2", 1.0, "config.optimizer.beta2 must be in [0, 1); got 1.0"),
    ("optimizer", "min_learning_rate_ratio", 2.0, "config.optimizer.min_learning_rate_ratio must be in [0, 1]"),
    ("data", "num_train_shards", 0, "config.data.num_train_shards must be >= 1; got 0"),
    ("sharding", "rules", (("h_(", (None,)),), "config.sharding.rules: 'h_(' is not a valid regex"),
    ("sharding", "logical_axis_rules", (("length",),),
     "config.sharding.logical_axis_rules entry ('length',) must be a (logical axis name, mesh "
     "axes) pair"),
    ("sharding", "logical_axis_rules", (("length", 4),),
     "config.sharding.logical_axis_rules entry ('length', 4) must be a mesh axis name, names, or None"),
    ("sharding", "logical_axis_rules", (("length", "seq"), ("length", None)),
     "config.sharding.logical_axis_rules names logical axis 'length' twice"),
])
def test_bad_values_are_named(section, key, value, message):
  config = default_config()
  config[section] = ml_collections.ConfigDict(dict(config[section]))  # Untyped, as a file may build it.
  config[section][key] = value
  with pytest.raises(UserError, match=re.escape(message)):
    to_run_config(config)


@pytest.mark.parametrize("family, key, value, message", [
    ("qwen3", "head_dim", 7, "config.model.head_dim must be even (RoPE turns pairs) and >= 0"),
    ("qwen3", "qkv_bias", True, "config.model.qkv_bias: Qwen3 has no query, key or value biases"),
    ("olmo2", "qkv_bias", True, "config.model.qkv_bias: OLMo 2 has no query, key or value biases"),
    ("olmo2", "sliding_window", 64, "config.model.sliding_window: olmo2 has no sliding window"),
    ("gemma3", "layer_types", "LLX", "config.model.layer_types must be 4 letters (num_layers), "
     "each L (local) or G (global)"),
    ("gemma3", "sliding_window", 0, "config.model.sliding_window must be positive: Gemma 3's "
     "local layers"),
    ("gemma3", "sliding_window_pattern", 0, "config.model.sliding_window_pattern must be >= 1"),
    ("gemma3", "rope_type", "llama3", "config.model.rope_type 'llama3': Gemma 3's global layers "
     "take default or linear"),
    ("gemma3", "final_logit_softcapping", -1.0, "config.model.final_logit_softcapping must be >= 0"),
])
def test_bad_family_values_are_named(family, key, value, message):
  config = load_config_file(f"{family}:nano")
  config.model[key] = value
  with pytest.raises(UserError, match=re.escape(message)):
    to_run_config(config)


def test_a_bad_cache_dtype_is_named():
  config = load_config_file("gpt2:nano")
  config.model.compute.cache_dtype = "int4"
  with pytest.raises(UserError, match=re.escape(
      "config.model.compute.cache_dtype must be auto, float32, bfloat16 or float16; got 'int4'")):
    to_run_config(config)


def test_gemma3s_final_soft_cap_with_the_blockwise_loss_is_one_line():
  config = load_config_file("gemma3:nano")
  config.model.final_logit_softcapping = 30.0
  to_run_config(config)  # Alone: built.
  config.model.compute.cross_entropy_block_size = 128
  with pytest.raises(UserError, match=r"^config.model.final_logit_softcapping is not built with "
                     r"config.model.compute.cross_entropy_block_size > 0"):
    to_run_config(config)


def test_the_eval_set_size_is_tokens_or_all():
  config = default_config()
  config.trainer.eval_tokens = "all"
  assert to_run_config(config).trainer.eval_tokens == "all"
  config.trainer.eval_tokens = "most"
  with pytest.raises(UserError, match=re.escape("config key config.trainer.eval_tokens must be a "
                                                "positive int or 'all'; got 'most'")):
    to_run_config(config)


def test_an_optimizer_key_the_chosen_optimizer_ignores_is_refused():
  config = default_config()
  config.optimizer.name = "adafactor"
  config.optimizer.weight_decay = 0.01  # Adafactor reads it.
  assert to_run_config(config).optimizer.name == "adafactor"
  config.optimizer.beta1 = 0.8
  with pytest.raises(UserError, match=re.escape(
      "config.optimizer.beta1 (0.8) does not apply to adafactor, which reads only weight_decay "
      "besides the schedule: set it back to its default (0.9) or choose another optimizer")):
    to_run_config(config)
  config.optimizer.name, config.optimizer.sophia_gamma = "adamw", 0.05
  config.optimizer.beta1 = 0.9
  with pytest.raises(UserError, match=r"config.optimizer.sophia_gamma \(0.05\) does not apply "
                                      r"to adamw"):
    to_run_config(config)


def test_a_schedule_key_the_chosen_schedule_ignores_is_refused():
  config = default_config()
  config.optimizer.schedule, config.optimizer.decay_fraction = "wsd", 0.3  # WSD reads it.
  assert to_run_config(config).optimizer.decay_fraction == 0.3
  config.optimizer.schedule = "cosine"
  with pytest.raises(UserError, match=re.escape(
      "config.optimizer.decay_fraction (0.3) does not apply to the cosine schedule, which reads "
      "only min_learning_rate_ratio, learning_rate, warmup_steps: set it back to its default "
      "(0.2) or choose another schedule (config.optimizer.schedule)")):
    to_run_config(config)
  config.optimizer.decay_fraction, config.optimizer.decay_shape = 0.2, "sqrt"
  with pytest.raises(UserError, match=r"config.optimizer.decay_shape \(sqrt\) does not apply to "
                                      r"the cosine schedule"):
    to_run_config(config)
  config.optimizer.schedule, config.optimizer.decay_shape = "constant", "linear"
  config.optimizer.min_learning_rate_ratio = 0.05  # A constant schedule never decays.
  with pytest.raises(UserError, match=r"min_learning_rate_ratio \(0.05\) does not apply to the "
                                      r"constant schedule, which reads only learning_rate, "
                                      r"warmup_steps"):
    to_run_config(config)


def test_a_wsd_warmup_must_end_before_its_decay():
  config = default_config()
  config.trainer.num_train_steps, config.optimizer.warmup_steps = 1000, 200
  config.optimizer.schedule, config.optimizer.decay_fraction = "wsd", 0.8  # Decay from step 200.
  assert to_run_config(config).optimizer.schedule == "wsd"
  config.optimizer.decay_fraction = 0.81
  with pytest.raises(UserError, match=re.escape(
      "config.optimizer.warmup_steps (200) must end by the start of WSD's decay, step 190: the "
      "last optimizer.decay_fraction (0.81) of trainer.num_train_steps (1000)")):
    to_run_config(config)


def test_wrong_type_is_named():
  config = default_config()
  # A config file that builds its own ConfigDict is not type-checked by it.
  config.trainer = ml_collections.ConfigDict({**config.trainer, "batch_size": "16"})
  with pytest.raises(UserError, match="config key config.trainer.batch_size must be a positive int or 'auto'; got '16'"):
    to_run_config(config)


def test_a_logical_axis_table_that_is_no_sequence_of_pairs_is_named():
  config = default_config()
  config.sharding = ml_collections.ConfigDict({**config.sharding, "logical_axis_rules": "length=seq"})
  with pytest.raises(UserError, match=re.escape("config.sharding.logical_axis_rules must be a "
                                                "sequence of (logical axis, mesh axes) pairs")):
    to_run_config(config)


def test_unknown_section_is_named():
  config = default_config()
  config.trainr = ml_collections.ConfigDict()
  with pytest.raises(UserError, match="unknown config section config.trainr"):
    to_run_config(config)


def test_bad_device_mesh_is_named():
  config = default_config()
  config.trainer.device_mesh = ml_collections.ConfigDict({"data": "four"})
  with pytest.raises(UserError, match="config key config.trainer.device_mesh must map axis names to sizes"):
    to_run_config(config)


def test_mixture_becomes_named_weighted_datasets():
  config = default_config()
  config.data.mixture.code = dict(dataset="stdlib", weight=3)
  config.data.mixture.web = dict(dataset="/data/web", weight=1.0)
  assert to_run_config(config).data.mixture == (("code", "stdlib", 3.0), ("web", "/data/web", 1.0))
  config.data.dataset = "/data/other"
  with pytest.raises(UserError, match="set config.data.dataset or config.data.mixture, not both"):
    to_run_config(config)


@pytest.mark.parametrize("value, policy", [(True, "full"), (False, "none"), ("true", "full"),
                                           ("dots_saveable", "dots_saveable")])
def test_remat_takes_booleans_and_policy_names(value, policy):
  config = default_config()
  # A config file may build its own ConfigDict with a boolean there.
  config.model = ml_collections.ConfigDict({**config.model, "remat": value})
  assert to_run_config(config).model.compute.remat == policy


def test_a_saved_config_without_a_newer_key_means_what_its_run_did():
  """Runs from before data.document_masking attended across documents, and from before
  model.compute.splash_fused_backward ran splash's two backward kernels; from before
  monitoring.hang_watchdog_seconds, they did what its default does."""
  from levanter_flax.config import changes, flat_dict
  now = flat_dict(to_run_config(default_config()))
  saved = {k: v for k, v in now.items()
           if k not in ("data.document_masking", "monitoring.hang_watchdog_seconds",
                        "model.compute.splash_fused_backward")}
  assert changes(saved, now) == ["data.document_masking False -> True",
                                 "model.compute.splash_fused_backward False -> True"]


@pytest.mark.parametrize("source, message", [
    ("X = 1\n", "config file {path} defines no get_config()"),
    ("def get_config():\n  raise ValueError('no such model')\n",
     "get_config() of config file {path} raised ValueError at line 2: no such model"),
    ("def get_config():\n  return {}['seq_len']\n",
     "get_config() of config file {path} raised KeyError at line 2: 'seq_len'"),
    ("def get_config():\n  pass\n",
     "get_config() of config file {path} returned a NoneType, not an ml_collections.ConfigDict"),
    ("import no_such_module\n",
     "config file {path} fails to load: ModuleNotFoundError at line 1: No module named"),
    ("def get_config(:\n", "config file {path} fails to load: SyntaxError at line 1: "),
])
def test_a_config_file_that_cannot_give_a_config_is_named_with_its_reason(tmp_path, source,
                                                                          message):
  path = tmp_path / "broken.py"
  path.write_text(source)
  with pytest.raises(UserError) as raised:
    load_config(str(path))
  assert str(raised.value).startswith(message.format(path=path)), raised.value
  assert "\n" not in str(raised.value)


@pytest.mark.parametrize("name", ["gpt2_nano", "gpt2:nano", "gpt2.py:nano", "configs/gpt2.py:nano",
                                  "configs/gpt2_nano.py"])
def test_a_shipped_config_is_found_by_name_from_any_directory(name, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # Not the checkout: configs/ is not here.
  assert load_config(name).to_dict() == load_config_file("gpt2:nano").to_dict()
  assert load_preset("optim/sophia_h_large").name == "sophia_h"
  assert load_preset("configs/optim/sophia_h_large.py").name == "sophia_h"


def test_the_shipped_configs_are_the_checkouts():
  """configs/ links to the package's configs, which the wheel ships (tests/test_install.py)."""
  assert (REPO / "configs").resolve() == SHIPPED_CONFIGS
  assert "gpt2_nano" in shipped_names() and "optim/sophia_h_large" not in shipped_names()
  assert shipped_names("*/*.py") == ["optim/sophia_h_large"]


def test_a_file_wins_over_a_shipped_name(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "gpt2_nano.py").write_text(
      "from levanter_flax.config import default_config\n"
      "def get_config():\n"
      "  config = default_config()\n"
      "  config.trainer.num_train_steps = 7\n"
      "  return config\n")
  assert load_config("gpt2_nano.py").trainer.num_train_steps == 7  # The file here.
  assert load_config("gpt2_nano").trainer.num_train_steps == 300  # The shipped config.
  assert find_config_file("gpt2_nano", "x") == SHIPPED_CONFIGS / "gpt2_nano.py"


@pytest.mark.parametrize("argument, message", [
    ("gpt3", "config file gpt3 does not exist, and is no shipped config's name; shipped: "
             "deepseek_v3, gemma3, gpt2, gpt2_medium,"),
    ("gpt3:nano", "config file gpt3 does not exist"),
    ("configs/nope.py", "config file configs/nope.py does not exist, and is no shipped"),
    ("../gpt2", "config file ../gpt2 does not exist"),
    ("./gpt2_nano", "config file ./gpt2_nano does not exist (a path from the working directory"),
    ("./gpt2:nano", "config file ./gpt2 does not exist (a path from the working directory"),
    ("gpt2:tiny", "config file gpt2: unknown variant 'tiny'; choose one of nano, small, medium, "
                  "small_fast"),
    ("gpt2_nano:small", "config file gpt2_nano is gpt2.py:nano and takes no variant; got 'small' "
                        "(for a variant of gpt2.py: --config=gpt2:small)"),
])
def test_a_config_neither_shipped_nor_a_file_is_named(argument, message, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(UserError) as raised:
    load_config(argument)
  assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_preset_that_is_neither_is_named(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(UserError, match=r"^config preset optim/adam does not exist, and is no "
                                      r"shipped config's name; shipped: optim/sophia_h_large$"):
    load_preset("optim/adam")


def test_a_config_file_that_is_not_python_is_named(tmp_path):
  (tmp_path / "run.yaml").write_text("trainer: {}\n")
  with pytest.raises(UserError, match=r"run.yaml is not a Python file \(.py\)$"):
    load_config(str(tmp_path / "run.yaml"))
