r"""The OpenAI HTTP API on a run's newest checkpoint, or on a Hugging Face checkpoint.

    levanter-flax serve --workdir=runs/sft [--host=127.0.0.1 --port=8000 --slots=8]
    levanter-flax serve --init_from_hf=/models/Qwen2-0.5B-Instruct --slots=16

Then any OpenAI client talks to it:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="sft", messages=[{"role": "user", "content": "Hi"}])

The model's name is the workdir's (or the directory's) last component, or --model_name.
/v1/chat/completions renders the messages with the run's chat template (the one its chat
datasets were prepared with, else the tokenizer's; --chat_template: a file); without one,
only /v1/completions serves. Requests generate together on the engine's --slots
(generate/engine.py). SIGTERM or Ctrl-C stops new requests, finishes the running ones, and
exits 0.
"""
from absl import app, flags, logging

from levanter_flax.core import cli
from levanter_flax.core.errors import UserError, exit_with_error
from levanter_flax.parallel import backend


def main(argv: list[str]) -> None:
  del argv
  flag = flags.FLAGS
  cli.quiet_orbax()
  try:
    from levanter_flax.generate import server as serving  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    exit_with_error(f"serve needs FastAPI and uvicorn ({e}): pip install -e \".[serve]\"")
  try:
    backend.open_devices()
    server = serving.load_server(
        flag.workdir, flag.init_from_hf, model_name=flag.model_name,
        chat_template=flag.chat_template, slots=flag.slots, max_len=flag.max_len,
        prefill_chunk=flag.prefill_chunk, decode_steps=flag.decode_steps,
        tensor_parallel=flag.tensor_parallel,
        cache_dtype=flag.cache_dtype or "")
  except UserError as e:
    exit_with_error(str(e))
  serving.serve(server, flag.host, flag.port, flag.warm_up)


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A training run's workdir: its newest usable checkpoint.")
  flags.DEFINE_string("init_from_hf", None, "Or a Hugging Face checkpoint directory (config.json, "
                      "safetensors, tokenizer.json).")
  flags.DEFINE_string("host", "127.0.0.1", "The address to listen on (0.0.0.0: every interface).")
  flags.DEFINE_integer("port", 8000, "The port to listen on.", lower_bound=1, upper_bound=65535)
  flags.DEFINE_integer("slots", 8, "Requests that generate together; more wait for a free slot.",
                       lower_bound=1)
  flags.DEFINE_integer("max_len", 0, "Tokens per request, prompt and completion (0: the model's "
                       "seq_len).", lower_bound=0)
  flags.DEFINE_integer("prefill_chunk", 128, "Prompt tokens a request prefills per engine step.",
                       lower_bound=1)
  flags.DEFINE_integer("decode_steps", 8, "Decode steps the device runs before the host reads "
                       "their tokens, while no prompt prefills: fewer host round trips, at most "
                       "decode_steps - 1 tokens past a stop computed and dropped, tokens "
                       "streamed in groups, and a new request's prefill up to that many steps "
                       "later.", lower_bound=1)
  flags.DEFINE_integer("tensor_parallel", 1, "Devices each layer's heads and widths split over "
                       "(the rest take slots); their count must divide the devices.",
                       lower_bound=1)
  flags.DEFINE_enum("cache_dtype", None, ["auto", "float32", "bfloat16", "float16"],
                    "The KV cache's dtype (auto: the compute dtype); default: the model "
                    "config's compute.cache_dtype. bfloat16 halves a float32 model's cache.")
  flags.DEFINE_bool("warm_up", True, "Compile every step shape before serving, so that no "
                    "request waits for a compile (seconds to minutes, with the model and slots).")
  flags.DEFINE_string("model_name", "", "The name clients ask for (default: the directory's).")
  flags.DEFINE_string("chat_template", "", "A Jinja chat template file for /v1/chat/completions.")
  app.run(main, flags_parser=cli.parse_flags)
