"""Command line: tokenize text into TFRecord shards plus a manifest for training.

  levanter-flax prepare --source=jsonl --input='data/*.jsonl.gz' \
      --output_dir=/data/my_corpus --train_tokenizer --vocab_size=32768

Then point a config at it: --config.data.dataset=/data/my_corpus (and
--config.data.tokenizer=/data/my_corpus/tokenizer.json for a trained tokenizer).

Chat data (JSON lines of {"messages": [{"role": ..., "content": ...}, ...]}),
rendered with the tokenizer's chat template, the loss on the assistant turns only:

  levanter-flax prepare --source=chat --input='chats/*.jsonl' \
      --tokenizer=qwen/tokenizer.json --output_dir=/data/my_chats

--source=prompt_completion reads {"prompt": ..., "completion": ...} lines: the
loss on the completion and the EOS after it.

Preference data for DPO (JSON lines of {"prompt" or "messages", "chosen",
"rejected"}, TRL's formats; data/preference.py), each pair one row of the
model's seq_len:

  levanter-flax prepare --source=preference --input='pairs/*.jsonl' \
      --tokenizer=qwen/tokenizer.json --seq_len=1024 --output_dir=/data/my_pairs

Killed and restarted with the same flags, it keeps the shards already written.
"""
import os

from absl import app, flags, logging

from levanter_flax.core import cli, paths
from levanter_flax.data import dataset_writer, shards, sources
from levanter_flax.core.errors import UserError, exit_with_error

_SOURCE = flags.DEFINE_enum("source", None, sources.KINDS, "Where documents come from.")
_INPUT = flags.DEFINE_list("input", [], "text/jsonl/parquet/chat/prompt_completion/preference: "
                           "files or "
                           "globs, local or gs:// "
                           "(.gz and .zst are read compressed); "
                           "tfds: the dataset name, e.g. lm1b or wikipedia/20230601.en.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where the shards and manifest go.")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "jsonl/parquet/tfds: the field (column) "
                                  "with the text.")
_SEPARATOR = flags.DEFINE_string("separator", "", "text: split files into documents on this "
                                 r"(escapes allowed, e.g. '\n\n'); default one document per file.")
_TFDS_SPLIT = flags.DEFINE_string("tfds_split", "train", "tfds: the split to read.")
_TFDS_DATA_DIR = flags.DEFINE_string("tfds_data_dir", "", "tfds: where the prepared data lives.")
_ON_DECODE_ERROR = flags.DEFINE_enum("on_decode_error", "replace", sources.DECODE_POLICIES,
                                     "Non-UTF-8 input: replace bad bytes (counted) or stop.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "byte", "'byte', a tokenizer.json (Hugging Face), "
                                 "or a SentencePiece .model file.")
_TRAIN_TOKENIZER = flags.DEFINE_bool("train_tokenizer", False, "Train a byte-level BPE on a "
                                     "sample of the train split first (--tokenizer_sample_mb); "
                                     "saved as <output_dir>/tokenizer.json.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 50257, "With --train_tokenizer: its size.")
_NUM_SHARDS = flags.DEFINE_integer("num_shards", 8, "Train shards (also validation shards); "
                                   "at least the number of training processes.", lower_bound=1)
_VALIDATION_FRACTION = flags.DEFINE_float("validation_fraction", 0.01,
                                          "Of documents, held out for eval.", 0.0, 0.99)
_TOKENIZER_SAMPLE_MB = flags.DEFINE_integer(
    "tokenizer_sample_mb", 1024, "With --train_tokenizer: MB of train text it learns from, taken "
    "evenly from the start of every shard's part of the corpus.", lower_bound=1)
_ENGINE = flags.DEFINE_enum("engine", "local", dataset_writer.ENGINES, "local: a process pool on this "
                            "machine; beam: an Apache Beam pipeline (pip install '.[beam]').")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", os.cpu_count(), "Parallel shard writers: "
                                    "local processes, or the local Beam runner's.", lower_bound=1)
_BEAM_PIPELINE_OPTIONS = flags.DEFINE_string(
    "beam_pipeline_options", "", "--engine=beam: Beam's own options, e.g. '--runner=DataflowRunner "
    "--project=P --region=R --temp_location=gs://B/tmp --setup_file=./setup.py'. Default: the "
    "local FnApiRunner with --num_workers processes.")
_CHAT_TEMPLATE = flags.DEFINE_string(
    "chat_template", "", "--source=chat: a Jinja chat template file; default: the tokenizer's, "
    "from chat_template.jinja or the chat_template of tokenizer_config.json beside its "
    "tokenizer.json.")
_SEQ_LEN = flags.DEFINE_integer(
    "seq_len", 0, "--source=preference: the tokens of each pair's row, the model's "
    "config.model.seq_len (pairs longer are skipped, counted).", lower_bound=0)
flags.mark_flags_as_required(["source", "output_dir"])


def options_from_flags() -> dataset_writer.PrepareOptions:
  """The flags as options; data.shards.PrepareOptions checks that they go together."""
  return dataset_writer.PrepareOptions(
      source=sources.SourceSpec(
          kind=_SOURCE.value, inputs=tuple(_INPUT.value), text_field=_TEXT_FIELD.value,
          separator=sources.decode_escapes(_SEPARATOR.value, "separator"),
          tfds_split=_TFDS_SPLIT.value, tfds_data_dir=_TFDS_DATA_DIR.value,
          on_decode_error=_ON_DECODE_ERROR.value),
      output_dir=paths.resolve(_OUTPUT_DIR.value, "--output_dir"),
      tokenizer=_TOKENIZER.value,
      train_tokenizer_vocab_size=_VOCAB_SIZE.value if _TRAIN_TOKENIZER.value else 0,
      tokenizer_sample_bytes=_TOKENIZER_SAMPLE_MB.value << 20,
      num_shards=_NUM_SHARDS.value,
      validation_fraction=_VALIDATION_FRACTION.value,
      engine=_ENGINE.value,
      num_workers=_NUM_WORKERS.value,
      beam_pipeline_options=shards.split_pipeline_options(_BEAM_PIPELINE_OPTIONS.value),
      chat_template=_CHAT_TEMPLATE.value,
      seq_len=_SEQ_LEN.value)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    exit_with_error(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    directory = dataset_writer.prepare_dataset(options_from_flags())
  except UserError as e:
    exit_with_error(str(e))
  logging.info("Dataset ready: %s", directory)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
