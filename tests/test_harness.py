"""lm-eval-harness (harness.py, evaluate.py, the in-run harness) against lm-eval's own Hugging
Face backend (HFLM) on a tiny seeded transformers Llama, with tasks written here as YAML over
local JSON lines. All offline."""
import contextlib
import json
import os
import sys

# Before datasets is imported: nothing may reach the network.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

import forkserver  # pylint: disable=g-import-not-at-top
from conftest import REPO, load_config_file, read_metrics, xla_flags  # pylint: disable=g-import-not-at-top
from test_chat import make_tokenizer  # pylint: disable=g-import-not-at-top
from test_hf import assert_one_error_line  # pylint: disable=g-import-not-at-top

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("lm_eval")

from lm_eval import evaluator  # pylint: disable=g-import-not-at-top
from lm_eval.api.instance import Instance  # pylint: disable=g-import-not-at-top
from lm_eval.models.huggingface import HFLM  # pylint: disable=g-import-not-at-top

from levanter_flax.eval import harness
from levanter_flax.hf import snapshot
from levanter_flax import models
from levanter_flax.parallel import partitioning
from levanter_flax.config import to_run_config  # pylint: disable=g-import-not-at-top
from levanter_flax.data import tokenizers  # pylint: disable=g-import-not-at-top
from levanter_flax.core.errors import UserError  # pylint: disable=g-import-not-at-top
from levanter_flax.training.loop import train_and_evaluate  # pylint: disable=g-import-not-at-top

SEQ_LEN = 64
GEN_TOKENS = 12
QUESTIONS = [f"hello there, question {i}: how are you" for i in range(6)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A seeded Llama with its byte-level BPE, as a hub snapshot holds them. Peaked logits (a
  scaled head) and norms away from 1, so that no greedy choice is a near tie between float
  orders, and a misplaced norm would show."""
  # The EOS both sides stop at: ours is the first EOS candidate, transformers' the config's.
  return make_llama(tmp_path_factory.mktemp("llama"), {"eos_token": "<|endoftext|>"})


def make_llama(directory, special_tokens: dict, likes_to_say: int | None = None,
               adds_bos: bool = False):
  """hf_dir's Llama, its tokenizer_config.json naming `special_tokens`; it stops at the corpus
  EOS and the config's eos_token, as export_hf writes it (and Qwen2-Instruct's generation
  config). `likes_to_say`: a token it says where it would have said another (its head row
  that token's, scaled up). `adds_bos`: the tokenizer.json's post-processor puts the BOS
  before every text, as Llama 3's, Mistral's and Gemma's do."""
  make_tokenizer(directory, template=None)
  if adds_bos:
    add_bos(directory / "tokenizer.json", special_tokens["bos_token"])
  (directory / "tokenizer_config.json").write_text(json.dumps(
      special_tokens | {"tokenizer_class": "PreTrainedTokenizerFast"}))
  eos_ids = sorted({0, tokenizers.load_tokenizer(str(directory / "tokenizer.json")
                                                 ).special_tokens["eos_token"][0]})
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
      tie_word_embeddings=False, eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
      bos_token_id=None))
  with torch.no_grad():
    for key, tensor in model.state_dict().items():
      if "norm" in key:
        tensor.add_(0.3 * torch.randn_like(tensor))
      if "lm_head" in key:
        tensor.mul_(30.0)
  if likes_to_say is not None:  # Said in place of the third token of QUESTIONS[0]'s answer.
    prompt = tokenizers.load_tokenizer(str(directory / "tokenizer.json")).encode(
        QUESTIONS[0], add_special_tokens=True)  # As HFLM encodes it.
    said = model.generate(torch.tensor([prompt.tolist()]), max_new_tokens=3, do_sample=False)
    with torch.no_grad():
      model.lm_head.weight[likes_to_say] = 1.2 * model.lm_head.weight[said[0, -1]]
  model.save_pretrained(directory)
  return directory


def add_bos(path, bos: str) -> None:
  """The tokenizer file at `path`, its post-processor putting `bos` before each text."""
  import tokenizers as hf_tokenizers  # pylint: disable=g-import-not-at-top  # Ours is `tokenizers`.
  tokenizer = hf_tokenizers.Tokenizer.from_file(str(path))
  tokenizer.post_processor = hf_tokenizers.processors.TemplateProcessing(
      single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))])
  tokenizer.save(str(path))


@pytest.fixture(scope="module")
def reference(hf_dir):
  return HFLM(pretrained=str(hf_dir), dtype="float32", batch_size=4, device="cpu")


@contextlib.contextmanager
def levanter_lm(hf_dir, batch_size):
  """LevanterLM on the import of the HF checkpoint, data-parallel over the 8 fake devices."""
  cfg, params = snapshot.load(hf_dir)
  mesh = partitioning.make_mesh((("data", -1), ("model", 1)))
  partitioner = partitioning.Partitioner(
      mesh, partitioning.ShardingConfig(rules=models.family(cfg).partition_rules))
  with partitioner.activation_context():
    yield harness.LevanterLM(cfg, params, tokenizers.load_tokenizer(str(hf_dir / "tokenizer.json")),
                             param_shardings=partitioner.param_shardings(params),
                             batch_sharding=partitioner.batch_sharding(), batch_size=batch_size)


@pytest.fixture(scope="module")
def ours(hf_dir):
  """Batches of 3 requests, rounded up to 8 rows."""
  with levanter_lm(hf_dir, batch_size=3) as lm:
    yield lm


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return path


def write_task(directory, config: dict) -> None:
  """A task YAML (JSON is YAML)."""
  (directory / f"{config['task']}.yaml").write_text(json.dumps(config, indent=1))


def local_task(name: str, data_file, **config) -> dict:
  return {"task": name, "dataset_path": "json",
          "dataset_kwargs": {"data_files": {"test": str(data_file)}}, "test_split": "test",
          "doc_to_text": "{{question}}", **config}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, reference):
  """tiny_mc (multiple choice: loglikelihood, acc) and tiny_gen (generate_until up to a stop
  string, exact_match). tiny_gen's stop string is one the reference model writes within its
  budget for the first question, and that question's answer is its text up to it: exact_match
  is 1/6 only if the text is cut there."""
  directory = tmp_path_factory.mktemp("tasks")
  rng = np.random.default_rng(0)
  write_jsonl(directory / "mc.jsonl", [
      {"question": q, "choices": [" fine", " hello there", " how are you", " tired"],
       "answer": int(rng.integers(4))} for q in QUESTIONS])
  write_task(directory, local_task("tiny_mc", directory / "mc.jsonl", output_type="multiple_choice",
                                   doc_to_choice="{{choices}}", doc_to_target="{{answer}}",
                                   metric_list=[{"metric": "acc"}]))
  uncut = reference.generate_until([Instance("generate_until", {}, (
      QUESTIONS[0], {"until": [], "max_gen_toks": GEN_TOKENS, "do_sample": False}), 0)])[0]
  stop = next(uncut[i:i + 2] for i in range(3, len(uncut) - 1)
              if "\ufffd" not in uncut[i:i + 2] and uncut[i:i + 2].strip())
  answers = [uncut.split(stop)[0]] + [f"answer {i}" for i in range(1, len(QUESTIONS))]
  write_jsonl(directory / "gen.jsonl", [{"question": q, "answer": a}
                                        for q, a in zip(QUESTIONS, answers)])
  write_task(directory, local_task(
      "tiny_gen", directory / "gen.jsonl", output_type="generate_until",
      doc_to_target="{{answer}}",
      generation_kwargs={"until": [stop], "max_gen_toks": GEN_TOKENS, "do_sample": False},
      metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]))
  return directory


def test_local_task_data_loads_offline(tasks):
  manager = harness.load_tasks(["tiny_mc", "tiny_gen"], str(tasks))
  assert manager.include_path  # Found in the directory alone: lm-eval's index was not needed.
  loaded = manager.load(["tiny_mc"])["tasks"]["tiny_mc"]
  assert len(list(loaded.test_docs())) == len(QUESTIONS)


def test_our_lm_gives_hflms_numbers(ours, reference, tasks):
  """The same accuracies, log-likelihoods within 1e-4 per request, the same generations."""
  manager = harness.load_tasks(["tiny_mc", "tiny_gen"], str(tasks))
  results = {name: evaluator.simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_gen"],
                                             task_manager=manager, log_samples=True)
             for name, lm in (("ours", ours), ("hf", reference))}
  for task, metric in (("tiny_mc", "acc,none"), ("tiny_gen", "exact_match,none")):
    assert results["ours"]["results"][task][metric] == results["hf"]["results"][task][metric]
  assert results["ours"]["results"]["tiny_gen"]["exact_match,none"] == pytest.approx(1 / 6)

  def responses(name, task):
    return [sample["resps"] for sample in results[name]["samples"][task]]
  ours_mc, hf_mc = responses("ours", "tiny_mc"), responses("hf", "tiny_mc")
  assert len(ours_mc) == len(QUESTIONS)
  for ours_doc, hf_doc in zip(ours_mc, hf_mc):
    for [(our_logprob, our_greedy)], [(hf_logprob, hf_greedy)] in zip(ours_doc, hf_doc):
      assert abs(our_logprob - hf_logprob) <= 1e-4 and our_greedy == hf_greedy
  assert responses("ours", "tiny_gen") == responses("hf", "tiny_gen")


def test_empty_contexts_long_pairs_and_rolling_windows_match_hflm(ours, reference):
  """An empty context (scored after the EOS), a pair longer than seq_len (cut on the left),
  and texts of several seq_len windows each, as lm-eval's rolling windows score them."""
  long_text = " ".join(QUESTIONS * 3)  # Several windows of 64 tokens.
  pairs = [("", "hello there"), (long_text, " how are you"), ("abc ", "def")]
  requests = [Instance("loglikelihood", {}, pair, 0) for pair in pairs]
  for (mine, _), (theirs, _) in zip(ours.loglikelihood(requests),
                                    reference.loglikelihood(requests)):
    assert abs(mine - theirs) <= 1e-4
  texts = [Instance("loglikelihood_rolling", {}, (text,), 0) for text in (long_text, "short")]
  assert len(ours.tok_encode(long_text)) > 2 * SEQ_LEN
  # Sums over hundreds of tokens: float32's rounding scales with them.
  np.testing.assert_allclose(ours.loglikelihood_rolling(texts),
                             reference.loglikelihood_rolling(texts), rtol=0, atol=1e-3)


@pytest.mark.parametrize("special_tokens,adds_bos", [
    ({"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"}, False),
    # Llama 3's, Mistral's, Gemma's: the tokenizer puts the BOS before each text, too.
    ({"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"}, True),
    ({"eos_token": "<|im_end|>"}, False),  # Qwen2-Instruct's: another EOS than the corpus's.
], ids=["bos", "bos_added", "other_eos"])
def test_the_tokenizer_configs_bos_or_eos_is_hflms_prefix_and_end(tmp_path, special_tokens,
                                                                  adds_bos):
  """HFLM's prefix (the config's BOS, else its EOS) before rolling windows and empty contexts,
  the tokenizer's own BOS before other texts, and its EOS ending generations: the numbers and
  texts of HFLM, not of the corpus EOS."""
  # It says <|im_end|> third in QUESTIONS[0]'s answer: with that EOS, the answer ends there.
  directory = make_llama(tmp_path / "llama", special_tokens, likes_to_say=2, adds_bos=adds_bos)
  reference = HFLM(pretrained=str(directory), dtype="float32", batch_size=4, device="cpu")
  pairs = [("", "hello there"), ("", " how are you"), ("abc ", "def")]
  texts = [" ".join(QUESTIONS * 3), "short"]
  greedy = {"until": ["\n\n"], "max_gen_toks": GEN_TOKENS, "do_sample": False}
  assert reference.prefix_token_id != 0  # Not the corpus EOS.
  with levanter_lm(directory, batch_size=3) as lm:
    requests = [Instance("loglikelihood", {}, pair, 0) for pair in pairs]
    np.testing.assert_allclose(lm.loglikelihood(requests), reference.loglikelihood(requests),
                               rtol=0, atol=1e-4)
    requests = [Instance("loglikelihood_rolling", {}, (text,), 0) for text in texts]
    np.testing.assert_allclose(lm.loglikelihood_rolling(requests),
                               reference.loglikelihood_rolling(requests), rtol=0, atol=1e-3)
    requests = [Instance("generate_until", {}, (q, greedy), 0) for q in QUESTIONS]
    generated = lm.generate_until(requests)
    assert generated == reference.generate_until(requests)
  if special_tokens["eos_token"] == "<|im_end|>":  # The answer ended there.
    prompt = torch.tensor([reference.tok_encode(QUESTIONS[0])])
    said = reference.model.generate(prompt, max_new_tokens=3, do_sample=False)[0, -3:].tolist()
    assert said[2] == 2 and generated[0] == reference.tok_decode(said[:2])


@pytest.mark.parametrize("config, message", [
    ('{"bos_token": "<s>"}', "its bos_token '<s>' is no token of the tokenizer"),
    ('{"eos_token": ', "cannot read .*tokenizer_config.json: Expecting value"),
    ('["eos_token"]', "tokenizer_config.json is not a JSON object"),
])
def test_a_bad_tokenizer_config_is_one_line_naming_it(tmp_path, config, message):
  make_tokenizer(tmp_path, template=None)
  (tmp_path / "tokenizer_config.json").write_text(config)
  with pytest.raises(UserError, match=message) as raised:
    tokenizers.load_tokenizer(str(tmp_path / "tokenizer.json")).special_tokens  # pylint: disable=expression-not-assigned
  assert "\n" not in str(raised.value)


def test_a_batch_size_above_the_requests_pads_rows_only_to_the_devices(ours, hf_dir):
  """evaluate --batch_size=100000 on a few requests: batches of 8 rows (the devices), the same
  answers, not 100000 rows of padding."""
  requests = [Instance("loglikelihood", {}, (q, " fine"), 0) for q in QUESTIONS[:3]]
  with levanter_lm(hf_dir, batch_size=100_000) as big:
    score, shapes = big._score, []  # pylint: disable=protected-access

    def recorded(params, inputs, targets):
      shapes.append(inputs.shape[0])
      return score(params, inputs, targets)
    big._score = recorded  # pylint: disable=protected-access
    assert big.loglikelihood(requests) == ours.loglikelihood(requests)
  assert shapes == [8]


@pytest.mark.slow
@pytest.mark.parametrize("names, message", [
    ("nope_not_a_task", "unknown lm-eval task 'nope_not_a_task'"),
    ("hellaswag", "lm-eval task 'hellaswag' cannot load its data: Couldn't reach 'Rowan/hellaswag'"),
    ("gone", "lm-eval task 'gone' cannot load its data: .*missing.jsonl"),
    ("bad_yaml", "lm-eval task 'bad_yaml' cannot be loaded: "),
    (" , ", "names no lm-eval task"),
])
def test_bad_tasks_are_one_line_naming_them(tasks, tmp_path, names, message):
  write_task(tmp_path, local_task("gone", tmp_path / "missing.jsonl", output_type="multiple_choice",
                                  doc_to_choice="{{choices}}", doc_to_target="{{answer}}"))
  write_task(tmp_path, local_task("bad_yaml", tasks / "mc.jsonl", output_type="no_such_output"))
  with pytest.raises(UserError, match=message) as raised:
    harness.load_tasks(harness.task_names(names, "--tasks"), str(tmp_path))
  assert "\n" not in str(raised.value)


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory, data_cache, tasks):
  config = harness_config(data_cache, tasks)
  workdir = tmp_path_factory.mktemp("run")
  train_and_evaluate(to_run_config(config), workdir)
  return config, workdir


def harness_config(data_cache, tasks):
  """A tiny Llama trained 4 steps on the built-in corpus, the harness every 2 steps."""
  config = load_config_file("llama_nano")
  config.model.seq_len, config.model.num_layers = SEQ_LEN, 1
  config.model.hidden_dim, config.model.intermediate_dim = 32, 64
  config.trainer.batch_size, config.trainer.num_train_steps = 8, 4
  config.trainer.log_every_steps, config.trainer.eval_every_steps = 2, 4
  config.trainer.eval_tokens = 512
  config.checkpoint.every_steps = 4
  config.data.cache_dir = str(data_cache)
  config.data.reader_groups = 1
  config.trainer.eval_harness_every_steps = 2
  config.trainer.eval_harness_tasks = "tiny_mc"
  config.trainer.eval_harness_include_path = str(tasks)
  config.trainer.eval_harness_limit = 4
  return config


@pytest.mark.slow
def test_the_in_run_harness_logs_at_its_steps(harness_run):
  _, workdir = harness_run
  logged = {m["step"]: m for m in read_metrics(workdir) if "harness/tiny_mc/acc" in m}
  assert sorted(logged) == [2, 4]
  for metrics in logged.values():
    assert 0 <= metrics["harness/tiny_mc/acc"] <= 1 and "harness/tiny_mc/acc_stderr" in metrics


@pytest.mark.slow
def test_a_missing_harness_task_stops_the_run_before_its_first_step(harness_run, tmp_path):
  config, _ = harness_run
  config.trainer.eval_harness_tasks = "tiny_mc,no_such_task"
  with pytest.raises(UserError, match="unknown lm-eval task 'no_such_task'"):
    train_and_evaluate(to_run_config(config), tmp_path / "run")
  assert not (tmp_path / "run" / "checkpoints").exists() or not any(
      (tmp_path / "run" / "checkpoints").iterdir())
  config.trainer.eval_harness_tasks = ""
  with pytest.raises(UserError, match="eval_harness_tasks names no lm-eval task"):
    to_run_config(config)
  config.trainer.eval_harness_tasks, config.trainer.eval_harness_every_steps = "tiny_mc", 0
  with pytest.raises(UserError, match="eval_harness_tasks is 'tiny_mc', but config.trainer."
                     "eval_harness_every_steps is 0"):
    to_run_config(config)
  config.trainer.eval_harness_tasks = ""
  with pytest.raises(UserError, match="eval_harness_include_path is '.*tasks.*', but config."
                     "trainer.eval_harness_every_steps is 0: no harness runs to read it"):
    to_run_config(config)
  config.trainer.eval_harness_include_path = ""
  with pytest.raises(UserError, match="eval_harness_limit is 4, but config.trainer."
                     "eval_harness_every_steps is 0: no harness runs to read it"):
    to_run_config(config)


def evaluate_cli(*flags):
  return forkserver.run([sys.executable, "-m", "levanter_flax.commands.evaluate", *flags], cwd=REPO,
                        capture_output=True, text=True, timeout=300,
                        env={**os.environ, "XLA_FLAGS": xla_flags(2)})


@pytest.mark.slow
def test_the_evaluate_command_writes_its_results(harness_run, hf_dir, tasks, tmp_path):
  _, workdir = harness_run
  result = evaluate_cli(f"--workdir={workdir}", "--tasks=tiny_mc", f"--include_path={tasks}",
                        "--limit=3", f"--output={tmp_path / 'run.json'}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "tiny_mc" in result.stdout and "acc" in result.stdout
  # No tqdm bar of lm-eval's or datasets' in a log (text=True turned their \r into lines).
  assert "it/s]" not in result.stderr
  assert json.loads((tmp_path / "run.json").read_text())["results"]["tiny_mc"]["acc,none"] >= 0

  result = evaluate_cli(f"--workdir={workdir}", "--tasks=tiny_mc", f"--include_path={tasks}",
                        "--limit=0.5", f"--output={tmp_path / 'half.json'}")  # Half the 6.
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads((tmp_path / "half.json").read_text())["n-samples"]["tiny_mc"]["effective"] == 3

  result = evaluate_cli(f"--init_from_hf={hf_dir}", "--tasks=tiny_mc,tiny_gen",
                        f"--include_path={tasks}", f"--output={tmp_path / 'hf.json'}")
  assert result.returncode == 0, result.stderr[-3000:]
  written = json.loads((tmp_path / "hf.json").read_text())["results"]
  assert written["tiny_gen"]["exact_match,none"] == pytest.approx(1 / 6)


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--tasks=nope_not_a_task"], "unknown lm-eval task 'nope_not_a_task'"),
    (["--tasks=tiny_mc", "--limit=0"], "--limit must be above 0"),
    (["--tasks=tiny_mc", "--limit=2.5"], "--limit must be a number of documents (a whole number) "
                                         "or a fraction below 1 of them; got 2.5"),
    (["--tasks=tiny_mc", "--output={tmp}"], "--output {tmp} is a directory"),
    (["--tasks=tiny_mc", "--output=/proc/results.json"], "cannot write --output /proc/results"),
    (["--tasks=tiny_mc", "--workdir={tmp}/nowhere"], "{tmp}/nowhere has no config.json"),
    # The model's directory is checked before the tasks' minutes of loading.
    (["--tasks=nope_not_a_task", "--workdir={tmp}"], "{tmp} has no config.json"),
    (["--tasks=tiny_mc", "--init_from_hf={tmp}"], "--init_from_hf {tmp} holds no config.json"),
    (["--tasks=tiny_mc", "--workdir={tmp}", "--init_from_hf={tmp}"], "not both or neither"),
])
def test_bad_evaluate_flags_are_one_line(hf_dir, tasks, tmp_path, flags, message):
  flags = [f.format(tmp=tmp_path) for f in flags]
  if not any(f.startswith(("--workdir", "--init_from_hf")) for f in flags):
    flags.append(f"--init_from_hf={hf_dir}")
  assert_one_error_line(evaluate_cli(*flags, f"--include_path={tasks}"),
                        message.format(tmp=tmp_path))


@pytest.mark.slow
def test_a_harness_lost_after_its_checkpoint_runs_on_resume_once(data_cache, tasks, tmp_path,
                                                                 monkeypatch):
  """A run stopped between a step's checkpoint and its harness (at step 2; then, resumed, at
  the last step 4) logs that step's harness/ metrics when resumed, once: on the next start,
  and on a start that finds the run finished; a start that finds them logged runs none."""
  config = harness_config(data_cache, tasks)
  config.checkpoint.every_steps = 2
  run, calls, run_harness = to_run_config(config), [], harness.InRun.__call__

  def dies_at(call):
    def harness_call(self, params):
      calls.append(len(calls) + 1)
      if len(calls) == call:
        raise RuntimeError("killed")
      return run_harness(self, params)
    monkeypatch.setattr(harness.InRun, "__call__", harness_call)

  def logged():
    return [m["step"] for m in read_metrics(tmp_path) if "harness/tiny_mc/acc" in m]
  dies_at(1)  # At step 2.
  with pytest.raises(RuntimeError, match="killed"):
    train_and_evaluate(run, tmp_path)
  assert logged() == []
  calls.clear()
  dies_at(2)  # Step 2's, rerun; then step 4's.
  with pytest.raises(RuntimeError, match="killed"):
    train_and_evaluate(run, tmp_path)
  assert logged() == [2]
  calls.clear()
  train_and_evaluate(run, tmp_path)  # Finished: step 4's only.
  assert logged() == [2, 4] and calls == [1]
  calls.clear()
  train_and_evaluate(run, tmp_path)
  assert logged() == [2, 4] and calls == []
