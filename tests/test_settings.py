"""Each setting is declared once, in its section's dataclass: default_config(), --print_config and
the kinds a resume checks (state, model, free, chosen at start) all come from that declaration;
old key names keep working with a warning."""
import dataclasses
import json
import logging
import pathlib
import subprocess
import sys

import pytest

import forkserver
from conftest import REPO, as_at_checkpoint, train_losses
from levanter_flax import config as config_module, models
from levanter_flax.core.errors import UserError
from levanter_flax.hf import snapshot
from levanter_flax.core import schema
from levanter_flax.config import settings
from levanter_flax.config import default_config, flat_dict, load_config_file, to_run_config
from levanter_flax.core.schema import CHOSEN, FREE, MODEL, STATE, setting
from levanter_flax.training.loop import train_and_evaluate

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("architecture", list(models.FAMILIES))
def test_every_setting_has_a_description_and_a_kind(architecture):
  declared = settings.declared(architecture)
  assert len({d.key for d in declared}) == len(declared)
  for d in declared:
    assert len(d.doc.split()) >= 2, d.key  # A description, not a placeholder.
    assert d.kind in schema.KINDS, d.key
  for field in dataclasses.fields(settings.RunConfig):
    assert field.metadata["doc"], field.name


def _leaves(config, prefix=""):
  """The setting keys of a ConfigDict: nested sections walked, other values (a mesh) leaves."""
  sections = {d.key.rsplit(".", 1)[0] for d in settings.declared("gpt2")}
  for key in config.keys():
    path = f"{prefix}{key}"
    if path in sections or path in settings.sections("gpt2"):
      yield from _leaves(config[key], f"{path}.")
    else:
      yield path


def test_default_config_holds_exactly_the_declared_defaults():
  config = default_config()
  assert sorted(_leaves(config)) == sorted(d.key for d in settings.declared("gpt2"))
  run = to_run_config(config)
  declared = settings.RunConfig()  # Every section at its dataclass defaults.
  declared = dataclasses.replace(declared, sharding=dataclasses.replace(
      declared.sharding, rules=models.family(declared.model).partition_rules))
  assert run == declared


def test_default_config_is_generated_from_the_dataclasses(monkeypatch):
  """A setting added to a section appears in default_config() with its default: nothing restates
  it."""
  @dataclasses.dataclass(frozen=True)
  class Extra:
    knob: int = setting(7, "A knob")

  sections = settings.sections("gpt2") | {"extra": Extra}
  monkeypatch.setattr(settings, "sections", lambda architecture: sections)
  assert default_config().extra.knob == 7


def test_what_a_resume_checks_comes_from_each_familys_declarations():
  common = {"model.architecture", "model.vocab_size", "model.num_layers", "model.num_heads",
            "model.hidden_dim", "model.tie_word_embeddings", "model.compute.param_dtype",
            "model.compute.scan_layers", "model.lora.rank", "model.lora.targets",
            "optimizer.name", "trainer.spike_policy", "trainer.spike_window"}
  # LoRA's rank and targets: which adapters the state holds; the spike policy and window: the
  # optimizer state's spike window.
  # GPT-2's position table has seq_len rows; RoPE has no table.
  assert set(settings.keys_of_kind(STATE, "gpt2")) == common | {"model.seq_len"}
  llama_state = common | {"model.num_kv_heads", "model.intermediate_dim", "model.qkv_bias"}
  assert set(settings.keys_of_kind(STATE, "llama")) == llama_state
  # The experts, their width and the shared ones; sigmoid scoring adds a bias to each router.
  moe_state = {f"model.moe.{key}" for key in ("num_experts", "expert_dim", "num_shared_experts",
                                               "scoring")}
  assert set(settings.keys_of_kind(STATE, "mixtral")) == llama_state | moe_state
  assert set(settings.keys_of_kind(STATE, "qwen3")) == llama_state | {"model.head_dim"}
  assert set(settings.keys_of_kind(STATE, "qwen3_moe")) == llama_state | moe_state | {
      "model.head_dim"}
  assert set(settings.keys_of_kind(STATE, "deepseek_v3")) == llama_state | moe_state | {
      f"model.{key}" for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                 "qk_rope_head_dim", "v_head_dim", "first_dense_layers")}
  assert set(settings.keys_of_kind(STATE, "olmo2")) == llama_state
  assert set(settings.keys_of_kind(STATE, "gemma3")) == llama_state | {"model.head_dim"}
  assert {"model.sliding_window", "model.sliding_window_pattern", "model.layer_types",
          "model.rope_local_theta", "model.query_pre_attn_scalar",
          "model.final_logit_softcapping"} <= set(settings.keys_of_kind(MODEL, "gemma3"))
  assert "model.seq_len" in settings.keys_of_kind(FREE, "llama")
  assert {"model.rope_theta", "model.sliding_window"} <= set(settings.keys_of_kind(MODEL, "mistral"))
  assert set(settings.keys_of_kind(CHOSEN, "qwen2")) == {
      "trainer.batch_size", "trainer.gradient_accumulation_steps", "data.reader_groups"}

  for name, refused in (("gpt2_nano", ["model.seq_len 128 -> 256"]), ("llama_nano", [])):
    before = flat_dict(to_run_config(load_config_file(f"configs/{name}.py")))
    assert config_module.state_changes(before, before | {"model.seq_len": 256}) == refused


def test_a_hugging_face_checkpoint_must_agree_on_state_and_model_settings_only():
  from levanter_flax.models.llama import LlamaConfig
  from levanter_flax.models.common import with_compute
  ours = LlamaConfig(vocab_size=64, seq_len=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     hidden_dim=32, intermediate_dim=48)
  free = with_compute(dataclasses.replace(ours, seq_len=4096, initializer_range=0.5),
                      scan_layers=True, dtype="bfloat16")
  assert snapshot.differences(free, ours) == []
  assert snapshot.differences(dataclasses.replace(ours, rope_theta=1e6), ours) == [
      "model.rope_theta 1000000.0 (checkpoint) != 10000.0 (config)"]
  # A mixture's routing is the checkpoint's too, its dispatch and losses the run's.
  from levanter_flax.models.qwen3_moe import Qwen3MoeConfig
  from levanter_flax.models.moe import MoeConfig
  mixture = Qwen3MoeConfig(**{f.name: getattr(ours, f.name) for f in dataclasses.fields(ours)
                              if f.name not in ("architecture", "moe")})
  assert {"moe.num_experts", "moe.num_experts_per_token", "moe.normalize_top_k"} <= set(
      snapshot.decided_by_checkpoint(mixture)) and "lora.rank" not in str(
      snapshot.decided_by_checkpoint(mixture))
  run_own = dataclasses.replace(mixture, moe=MoeConfig(
      num_experts=128, num_experts_per_token=8, capacity_factor=1.5, router_aux_loss_coef=0.5))
  assert snapshot.differences(run_own, mixture) == []
  assert snapshot.differences(dataclasses.replace(mixture, moe=MoeConfig(
      num_experts=4, num_experts_per_token=2)), mixture) == [
          "model.moe.num_experts 4 (checkpoint) != 128 (config)",
          "model.moe.num_experts_per_token 2 (checkpoint) != 8 (config)"]


def test_what_the_start_chooses_is_kept_from_config_json():
  wanted = {"trainer.batch_size": "auto", "trainer.gradient_accumulation_steps": 1,
            "data.reader_groups": 0, "trainer.seed": 0}
  assert set(config_module.chosen_at_start(wanted)) == {
      "trainer.batch_size", "trainer.gradient_accumulation_steps", "data.reader_groups"}
  saved = {"trainer.batch_size": 48, "trainer.gradient_accumulation_steps": 3,
           "data.reader_groups": 8, "trainer.seed": 5}
  assert config_module.keep_chosen(wanted, saved) == saved | {"trainer.seed": 0}
  fixed = wanted | {"trainer.batch_size": 16, "data.reader_groups": 2}
  assert config_module.chosen_at_start(fixed) == ()
  assert config_module.keep_chosen(fixed, saved) == fixed


def _config_file(tmp_path: pathlib.Path, body: str) -> pathlib.Path:
  path = tmp_path / "old_names.py"
  path.write_text("from levanter_flax.config import load_config_file\n\n\ndef get_config():\n"
                  f"  config = load_config_file('{REPO}/configs/gpt2.py:nano')\n{body}"
                  "  return config\n")
  return path


def test_old_names_in_a_config_file_work_with_a_warning(tmp_path, capsys):
  path = _config_file(tmp_path, "  config.trainer.keep_checkpoints = 7\n"
                                "  config.model.remat = 'full'\n")
  run = to_run_config(load_config_file(str(path)))
  assert (run.checkpoint.keep, run.model.compute.remat) == (7, "full")
  assert capsys.readouterr().err.splitlines() == [
      "warning: config key config.model.remat is deprecated: use config.model.compute.remat",
      "warning: config key config.trainer.keep_checkpoints is deprecated: use "
      "config.checkpoint.keep"]


def _print_config(*args: str) -> subprocess.CompletedProcess:
  return forkserver.run([sys.executable, "-m", "levanter_flax.main", *args, "--print_config"],
                        cwd=REPO, capture_output=True, text=True, timeout=300)


def test_print_config_lists_every_key_and_touches_nothing(tmp_path):
  workdir = tmp_path / "never"
  result = _print_config("--config=configs/llama.py:nano", "--config.trainer.seed=3",
                         "--config.trainer.keep_checkpoints=5", f"--workdir={workdir}")
  assert result.returncode == 0, result.stderr
  assert result.stderr.splitlines() == ["warning: config key --config.trainer.keep_checkpoints is "
                                        "deprecated: use config.checkpoint.keep"]
  lines = result.stdout.splitlines()
  keys = [line.split(" = ")[0].removeprefix("config.") for line in lines
          if line.startswith("config.")]
  assert keys == [d.key for d in settings.declared("llama")]
  assert "config.trainer.seed = 3  (default 0)" in lines
  assert "config.checkpoint.keep = 5  (default 3)" in lines
  assert "config.trainer.log_every_steps = 10" in lines  # At its default: no "(default ...)".
  assert "config.model.num_kv_heads = 2  (no default)" in lines
  seq_len = lines.index("config.model.seq_len = 128  (no default)")
  assert lines[seq_len + 1].startswith("    Tokens per training window; a resume may change it")
  assert lines[seq_len + 1].endswith(" [free]")
  assert "# config.checkpoint: When checkpoints are written, which are kept, and where a run " \
         "starts from" in lines
  assert not workdir.exists()


def test_a_flag_overrides_an_old_name_in_the_config_file(tmp_path):
  path = _config_file(tmp_path, "  config.model.remat = 'full'\n")
  result = _print_config(f"--config={path}", "--config.model.compute.remat=dots_saveable")
  assert result.returncode == 0, result.stderr
  assert "config.model.compute.remat = 'dots_saveable'  (default 'none')" in result.stdout


def test_a_bad_value_with_print_config_is_one_line():
  result = _print_config("--config=configs/gpt2.py:nano", "--config.trainer.nan_policy=maybe")
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      "levanter_flax: error: config.trainer.nan_policy must be 'halt' or 'skip'; got 'maybe'"]


@pytest.mark.slow
def test_a_config_json_with_the_old_key_names_resumes_unchanged(tiny_config, tmp_path, caplog):
  """config.json as the version before the sections moved wrote it (tests/fixtures), beside this
  version's checkpoints: the resume takes it as the same run and continues it exactly."""
  tiny_config.checkpoint.every_steps = 5
  # That version's defaults, which a resume would otherwise log as changes.
  tiny_config.trainer.jax_persistent_cache_min_compile_time_secs = 1.0
  tiny_config.model.compute.splash_fused_backward = False
  tiny_config.batch_search.memory_fraction = 0.85
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "whole")
  as_at_checkpoint(tmp_path / "whole", tmp_path / "resumed", 5)
  old = (FIXTURES / "config_before_issue_30.json").read_text()
  (tmp_path / "resumed" / "config.json").write_text(
      old.replace("CACHE_DIR", tiny_config.data.cache_dir))
  assert "trainer.keep_checkpoints" in json.loads(old)
  with caplog.at_level(logging.WARNING):
    train_and_evaluate(to_run_config(tiny_config), tmp_path / "resumed")
  assert "Resuming with" not in caplog.text
  assert train_losses(tmp_path / "resumed") == train_losses(tmp_path / "whole")
  saved = json.loads((tmp_path / "resumed" / "config.json").read_text())
  assert saved["checkpoint.keep"] == 3 and "trainer.keep_checkpoints" not in saved


def test_old_names_in_a_sweep_work_with_a_warning(capsys):
  from levanter_flax.launch.experiment import Experiment, work_units
  [unit] = work_units(Experiment("e", "configs/gpt2.py:nano", [],
                                 overrides={"trainer.keep_checkpoints": 5}))
  assert unit.overrides == {"checkpoint.keep": 5}
  assert unit.resolved["checkpoint.keep"] == 5
  assert "warning: config key config.trainer.keep_checkpoints is deprecated: use " \
         "config.checkpoint.keep" in capsys.readouterr().err


def test_old_compute_names_given_to_model_config_work_with_a_warning(capsys):
  model = config_module.model_config("llama", vocab_size=64, seq_len=16, num_layers=2,
                                     num_heads=4, num_kv_heads=2, hidden_dim=32,
                                     intermediate_dim=48, scan_layers=True)
  assert model.compute.scan_layers is True
  assert capsys.readouterr().err.splitlines() == [
      "warning: config key model_config(scan_layers=...) is deprecated: use "
      "config.model.compute.scan_layers"]


def test_an_old_name_and_its_new_one_set_differently_are_refused(tmp_path):
  path = _config_file(tmp_path, "  config.trainer.keep_checkpoints = 4\n"
                                "  config.checkpoint.keep = 9\n")
  with pytest.raises(UserError, match=r"^config.trainer.keep_checkpoints \(4\) is "
                     r"the old name of config.checkpoint.keep, which is set to 9: set "
                     r"config.checkpoint.keep only$"):
    load_config_file(str(path))


def test_an_old_name_in_a_section_the_file_dropped_lands_in_its_new_section(tmp_path):
  path = _config_file(tmp_path, "  del config['monitoring']\n"
                                "  config.trainer.hang_watchdog_seconds = 60.0\n")
  assert to_run_config(load_config_file(str(path))).monitoring.hang_watchdog_seconds == 60.0


def test_an_old_boolean_flag_set_false_is_renamed():
  result = _print_config("--config=configs/llama.py:7b", "--noconfig.model.scan_layers")
  assert result.returncode == 0, result.stderr
  assert "config.model.compute.scan_layers = False  (default False)" not in result.stdout
  assert "config.model.compute.scan_layers = False" in result.stdout.splitlines()


def test_a_config_json_of_an_unknown_family_is_named():
  with pytest.raises(UserError, match=r"^model.architecture 'falcon' is none of "):
    config_module.model_from_saved({"model.architecture": "falcon"})


def test_another_coordinator_or_process_id_is_no_change_on_resume(tmp_path):
  from levanter_flax.training import resume_checks
  run = to_run_config(load_config_file("configs/gpt2.py:nano"))
  saved = flat_dict(run) | {"trainer.distributed.process_id": 3,
                            "trainer.distributed.coordinator_address": "10.0.0.1:1234"}
  assert resume_checks.check_resumed_config(run, saved, tmp_path) == []
  assert resume_checks.check_resumed_config(run, saved | {"trainer.seed": 9}, tmp_path) == [
      "trainer.seed 9 -> 0"]


def test_a_familys_own_section_defaults_are_its_defaults_everywhere():
  """Qwen3-MoE's moe section defaults to 128 experts, DeepSeek-V3's to sigmoid routing: in a
  config file's model_config, in what a config.json without the key means, in --print_config."""
  from levanter_flax.config import loading, model_config
  sizes = dict(vocab_size=256, seq_len=32, num_layers=2, num_heads=4, num_kv_heads=4,
               hidden_dim=64, intermediate_dim=96)
  assert model_config("qwen3_moe", **sizes).moe.num_experts == 128
  assert loading.defaults("qwen3_moe")["model.moe.num_experts"] == 128
  assert loading.defaults("deepseek_v3")["model.moe.scoring"] == "sigmoid"
  assert loading.defaults("mixtral")["model.moe.scoring"] == "softmax"
  run = to_run_config(load_config_file("configs/deepseek_v3.py:nano"))
  printed = loading.describe_config(run)
  assert "config.model.moe.num_experts = 16  (default 256)" in printed
  assert "config.model.moe.scoring = 'sigmoid'\n" in printed
