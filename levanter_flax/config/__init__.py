"""The config edge: configs/ files, --config.KEY flags and saved config.json in, the plain
typed RunConfig out (loading); the sections gathered into RunConfig (settings). Every module
below declares its own section (core.schema); this package is the one that knows them all.
May import every package but train, eval, generate and the commands.

Config files import the helpers they build on from here (`from levanter_flax.config import
default_config, mesh`), so this package re-exports loading's public names.
"""
from levanter_flax.config.loading import (
    mesh, expert_parallel, default_config, model_config, llama_model_config, SHIPPED_CONFIGS, shipped_names,
    find_config_file, load_preset, load_config_file, define_config_flag, call_from_file,
    REPLACED_KEYS, replacement, ALIASES, modern_key, modern_argv, parse_flags,
    run_config_of_flags, to_run_config, flat_dict, model_from_saved, describe_config,
    modern_saved, read_saved, defaults, changes, state_changes, chosen_at_start, keep_chosen,
    model_like, sibling_config, choose_variant, variant_file, run_name)

__all__ = [
    "mesh", "expert_parallel", "default_config", "model_config", "llama_model_config", "SHIPPED_CONFIGS",
    "shipped_names", "find_config_file", "load_preset", "load_config_file",
    "define_config_flag", "call_from_file", "REPLACED_KEYS", "replacement", "ALIASES",
    "modern_key", "modern_argv", "parse_flags", "run_config_of_flags", "to_run_config",
    "flat_dict", "model_from_saved", "describe_config", "modern_saved", "read_saved",
    "defaults", "changes", "state_changes", "chosen_at_start", "keep_chosen", "model_like",
    "sibling_config", "choose_variant", "variant_file", "run_name"]
