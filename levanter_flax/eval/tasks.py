"""lm-eval tasks on a trained run or an HF checkpoint (generate.trained finds the model and
tokenizer): the harness run on them, the results written. The evaluate command's library."""
import json

import jax
from etils import epath

from levanter_flax import models
from levanter_flax.core import paths
from levanter_flax.core.errors import UserError
from levanter_flax.parallel import partitioning


def lm_eval_harness():
  """harness.py, which needs lm-eval (an extra): its absence is one line."""
  try:
    from levanter_flax.eval import harness  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise UserError(f"lm-eval-harness is not installed ({e}): pip install -e \".[eval]\"") from None
  return harness


def evaluate(model_cfg, params, tokenizer, names: list[str], manager, *, batch_size: int,
             limit: int | float | None, num_fewshot: int | None, max_gen_toks: int) -> dict:
  """lm-eval's results for `names`, the batches data-parallel over every device."""
  harness = lm_eval_harness()
  if jax.process_count() > 1:
    raise UserError("levanter-flax evaluate runs on one process; run it on one host")
  mesh = partitioning.make_mesh((("data", -1), ("model", 1)))
  partitioner = partitioning.Partitioner(
      mesh, partitioning.ShardingConfig(rules=models.family(model_cfg).partition_rules))
  with partitioner.activation_context():
    lm = harness.LevanterLM(model_cfg, params, tokenizer,
                            param_shardings=partitioner.param_shardings(params),
                            batch_sharding=partitioner.batch_sharding(), batch_size=batch_size,
                            max_gen_toks=max_gen_toks)
    return harness.evaluate(lm, names, manager, limit=limit, num_fewshot=num_fewshot)


def write_results(results: dict, output: epath.Path) -> None:
  from lm_eval.utils import handle_non_serializable  # pylint: disable=g-import-not-at-top
  text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
  try:
    paths.write_atomically(output, text)
  except OSError as e:
    raise UserError(f"cannot write --output {output}: {e.strerror or e}") from None


def document_limit(limit: float | None) -> int | float | None:
  """--limit as lm-eval takes it: a count of documents per task, or below 1 a fraction of them."""
  if limit is None or limit < 1:
    return limit
  if limit != int(limit):
    raise UserError(f"--limit must be a number of documents (a whole number) or a fraction "
                    f"below 1 of them; got {limit}")
  return int(limit)
