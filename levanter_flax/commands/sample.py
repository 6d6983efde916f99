r"""Text from the latest checkpoint of a run, decoded on a KV cache.

    levanter-flax sample --workdir=runs/gpt2_nano --prompt="def " --prompt="import " \
        --max_new_tokens=100 --temperature=0.8 --top_k=40

The prompts generate together on the engine (generate/engine.py), prompt i with seed
--seed + i. temperature 0 is greedy decoding; top_k and top_p restrict sampling to the
likeliest tokens.
Each prompt follows an EOS, as every document the model trained on did
(--no_bos: not), so an empty prompt starts a new document. The tokenizer is
the run's (config.json's data.tokenizer), and must still be the file its
datasets were tokenized with.

    levanter-flax sample --workdir=runs/chat --chat --system="Be brief." \
        --prompt="What is a KV cache?" --max_new_tokens=200

--chat renders each prompt as a user message with the run's chat template
(data/chat.py, as transformers' apply_chat_template(add_generation_prompt=True)
does) and prints the reply alone, which ends at the template's end-of-turn token
(what it writes after a reply, e.g. <|im_end|>) or the EOS, both left out.
"""
import dataclasses

from absl import app, flags

from levanter_flax.core import cli, paths
from levanter_flax.core.errors import UserError, exit_with_error
from levanter_flax.generate import trained
from levanter_flax.generate.engine import SamplingParams
from levanter_flax.generate.prompts import LONG_PROMPTS, chat_prompts, check_text, encode, generate
from levanter_flax.generate.trained import run_params
from levanter_flax.parallel import backend


def main(argv: list[str]) -> None:
  del argv
  flag = flags.FLAGS
  sampling = SamplingParams(max_tokens=flag.max_new_tokens, temperature=flag.temperature,
                            top_k=flag.top_k, top_p=flag.top_p, seed=flag.seed)
  cli.quiet_orbax()
  try:
    backend.open_devices()
    if not flag.prompt:
      raise UserError("give at least one --prompt")
    for name in ("system", "chat_template"):
      if flag[name].value and not flag.chat:
        raise UserError(f"--{name} needs --chat")
    check_text(flag.prompt)
    check_text([flag.system], "--system")
    workdir = paths.resolve(flag.workdir, "--workdir")
    model_cfg, params, saved = run_params(workdir)
    tokenizer = trained.run_tokenizer(workdir, saved)
    texts = flag.prompt
    sampling = dataclasses.replace(sampling, stop_ids=tokenizer.stop_ids)
    if flag.chat:
      template = trained.chat_template(saved, tokenizer, flag.chat_template)
      texts, stop_ids = chat_prompts(template, tokenizer, flag.prompt, flag.system)
      sampling = dataclasses.replace(sampling, stop_ids=stop_ids)
    prompts = encode(tokenizer, texts, bos=not flag.no_bos)
    continuations = generate(model_cfg, params, prompts, sampling, flag.long_prompt)
    for prompt, continuation in zip(flag.prompt, continuations):
      reply = tokenizer.decode(continuation)
      print(f"--- {prompt!r}\n{reply if flag.chat else prompt + reply}")
  except UserError as e:
    exit_with_error(str(e))


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A training run's workdir.", required=True)
  flags.DEFINE_multi_string("prompt", [], "A prompt; repeat the flag for a batch.")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.", lower_bound=1)
  flags.DEFINE_float("temperature", 1.0, "0: greedy.", lower_bound=0)
  flags.DEFINE_integer("top_k", 0, "Sample among the k likeliest tokens (0: all).", lower_bound=0)
  flags.DEFINE_float("top_p", 1.0, "Sample among the likeliest tokens that reach this "
                     "probability (1: all).", lower_bound=0, upper_bound=1)
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_enum("long_prompt", "error", LONG_PROMPTS,
                    "A prompt too long for seq_len - max_new_tokens: refuse it, or keep its end.")
  flags.DEFINE_bool("no_bos", False, "Feed each prompt alone, not after the EOS that began "
                    "every training document.")
  flags.DEFINE_bool("chat", False, "Each prompt is a user message, rendered with the run's chat "
                    "template; print the reply, up to the template's end-of-turn token or the EOS.")
  flags.DEFINE_string("system", "", "--chat: a system message before each prompt.")
  flags.DEFINE_string("chat_template", "", "--chat: a Jinja chat template file; default: the one "
                      "the run's chat datasets were prepared with, else the tokenizer's own.")
  app.run(main, flags_parser=cli.parse_flags)
