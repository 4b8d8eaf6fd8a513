"""Train a next-token model on a sequence feature: the SparseCore quickstart, ported.

The model, in the quickstart's shape: token ids [B, L] -> a sequence feature
looked up to [B, L, D] (one table row per position, no combiner) ->
flatten -> a dense MLP -> logits over the vocabulary, softmax cross-entropy
against the token that follows. It trains with the pipelined Trainer, with
checkpoints and resume (--workdir) and a plot of the training loss.

The data:
  * default: a corpus the example generates itself from a random order-2
    Markov source (a small stochastic grammar): after the tokens (a, b) comes
    one of --successors tokens, with random probabilities. The best possible
    model has the source's entropy rate H (nats per token) as its loss and
    perplexity exp(H); the example prints H and the trained model's loss
    falls toward it.
  * --text FILE: any text, read as UTF-8 characters (the vocabulary is the
    file's distinct characters); the first 90% trains, the last 10%
    evaluates.

Run:  python examples/sequence_lm.py                 (train, checkpoint, plot)
      python examples/sequence_lm.py                 (again: resumes, trains further)
      python examples/sequence_lm.py --text book.txt --seq-len 16
The last line printed is one JSON object with the final figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

EVAL_FRACTION = 0.1
PADDING_ID = -1
# The generated source draws a [V, V, V] array (8 bytes a value): 512 takes 1 GiB.
MAX_GENERATED_VOCAB = 512


# --- the corpora ---------------------------------------------------------------


class MarkovSource:
  """A random order-2 Markov source over `vocab` tokens.

  For every context (a, b), `successors` distinct next tokens with Dirichlet(1)
  probabilities: P(c | a, b). The entropy rate is

    H = sum over (a, b) of pi(a, b) * H(P(. | a, b)),

  pi the stationary distribution of the pair chain (a, b) -> (b, c), found by
  power iteration.
  """

  def __init__(self, vocab: int, successors: int, seed: int):
    rng = np.random.default_rng([seed, 1])
    self.vocab = vocab
    keys = rng.random((vocab, vocab, vocab))
    self.next_tokens = np.argsort(keys, axis=-1)[..., :successors]  # [V, V, k]
    self.probabilities = rng.dirichlet(np.ones(successors), size=(vocab, vocab))  # [V, V, k]

  def stationary(self, iterations: int = 500) -> np.ndarray:
    """pi [V, V]: the long-run frequency of each pair of consecutive tokens."""
    v = self.vocab
    pi = np.full((v, v), 1.0 / (v * v))
    second = np.broadcast_to(np.arange(v)[None, :, None], self.next_tokens.shape)
    for _ in range(iterations):
      new = np.zeros_like(pi)
      np.add.at(new, (second, self.next_tokens), pi[..., None] * self.probabilities)
      # A lazy step keeps the iteration convergent on a periodic chain.
      pi = 0.5 * pi + 0.5 * new
    return pi / pi.sum()

  def entropy_rate(self) -> float:
    """H in nats per token (module docstring)."""
    p = self.probabilities
    conditional = -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=-1)
    return float((self.stationary() * conditional).sum())

  def sample(self, length: int, seed: int) -> np.ndarray:
    """A token stream of `length` tokens (after a burn-in of 1000)."""
    rng = np.random.default_rng([seed, 2])
    burn_in = 1000
    tokens = np.empty(length + burn_in, np.int64)
    tokens[:2] = rng.integers(0, self.vocab, 2)
    choices = rng.random(tokens.size)
    cumulative = np.cumsum(self.probabilities, axis=-1)
    for t in range(2, tokens.size):
      a, b = tokens[t - 2], tokens[t - 1]
      k = min(int(np.searchsorted(cumulative[a, b], choices[t], side="right")),
              cumulative.shape[-1] - 1)
      tokens[t] = self.next_tokens[a, b, k]
    return tokens[burn_in:]


def text_tokens(path: str) -> tuple[np.ndarray, list[str]]:
  """The file's characters as ids, and the vocabulary (sorted distinct characters)."""
  from etils import epath

  text = epath.Path(path).read_text(encoding="utf-8")
  vocabulary = sorted(set(text))
  index = {char: i for i, char in enumerate(vocabulary)}
  return np.fromiter((index[c] for c in text), np.int64, count=len(text)), vocabulary


class Windows:
  """Batches of (L tokens -> the next one) drawn from a token stream; re-iterable.

  Batch i depends only on (seed, i): B windows at random offsets of `tokens`.
  The iterator exposes get_state()/set_state() for exact resume.
  """

  def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, *, seed: int,
               num_batches: int | None = None):
    self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
    self.seed, self.num_batches = seed, num_batches

  def batch(self, index: int) -> dict[str, Any]:
    rng = np.random.default_rng([self.seed, index])
    starts = rng.integers(0, self.tokens.size - self.seq_len, self.batch_size)
    windows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]
    return {"sparse": {"tokens": windows[:, :-1]}, "dense": None, "labels": windows[:, -1]}

  def __iter__(self) -> "_WindowIterator":
    return _WindowIterator(self)


class _WindowIterator:
  def __init__(self, source: Windows):
    self._source, self._index = source, 0

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, Any]:
    if self._source.num_batches is not None and self._index >= self._source.num_batches:
      raise StopIteration
    self._index += 1
    return self._source.batch(self._index - 1)

  def get_state(self) -> dict[str, int]:
    return {"index": self._index}

  def set_state(self, state: dict[str, int]) -> None:
    self._index = int(state["index"])


# --- the model -----------------------------------------------------------------


def build_feature_specs(batch_size: int, seq_len: int, vocab: int, embedding_dim: int,
                        learning_rate: float):
  """One sequence feature: ids [B, L] -> activations [B, L, D]."""
  from sc_framework import FeatureSpec, TableSpec
  from sc_framework.optimizers import Adagrad

  table = TableSpec("tokens", vocab, embedding_dim, optimizer=Adagrad(learning_rate),
                    max_ids_per_partition=batch_size * seq_len,
                    max_unique_ids_per_partition=min(vocab, batch_size * seq_len))
  return [FeatureSpec("tokens", table, input_shape=(batch_size, seq_len),
                      output_shape=(batch_size, seq_len, embedding_dim))]


def build_model(vocab: int, hidden: int):
  """(activations, dense) -> logits [B, vocab]: flatten [B, L, D], MLP."""
  from flax import linen as nn

  class NextToken(nn.Module):
    vocab: int
    hidden: int

    @nn.compact
    def __call__(self, activations, dense):
      sequence = activations["tokens"]  # [B, L, D]
      x = sequence.reshape(sequence.shape[0], -1)
      if self.hidden:
        x = nn.relu(nn.Dense(self.hidden)(x))
      return nn.Dense(self.vocab)(x)

  return NextToken(vocab, hidden)


def cross_entropy(logits, labels):
  import optax

  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# --- the command line ----------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
  from sc_framework.cli_types import integer_at_least, positive_float, workdir_path
  from sc_framework.cli_types import seed as seed_type

  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0], allow_abbrev=False,
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=integer_at_least(0), default=2000,
                      help="training steps of this run")
  parser.add_argument("--batch-size", type=integer_at_least(1), default=128,
                      help="windows per (global) batch; a multiple of the device count")
  parser.add_argument("--seq-len", type=integer_at_least(1), default=8,
                      help="L, tokens of context per window")
  parser.add_argument("--embedding-dim", type=integer_at_least(1), default=16,
                      help="D, the embedding dimension")
  parser.add_argument("--hidden", type=integer_at_least(0), default=128,
                      help="width of the hidden layer; 0: logits straight from the flattened"
                           " embeddings")
  parser.add_argument("--vocab", type=integer_at_least(1), default=32,
                      help=f"tokens of the generated source, at most {MAX_GENERATED_VOCAB}"
                           " (ignored with --text)")
  parser.add_argument("--successors", type=integer_at_least(1), default=3,
                      help="possible next tokens per context of the generated source")
  parser.add_argument("--corpus-tokens", type=integer_at_least(1), default=100_000,
                      help="length of the generated corpus")
  parser.add_argument("--text", default=None, metavar="FILE",
                      help="train on this UTF-8 text file (characters as tokens) instead")
  parser.add_argument("--eval-batches", type=integer_at_least(1), default=8,
                      help="batches of the held-out part for the perplexity")
  parser.add_argument("--pipelining", action=argparse.BooleanOptionalAction, default=True,
                      help="overlap the lookup of batch k+1 with the dense step of batch k")
  parser.add_argument("--workdir", type=workdir_path, default="sequence_lm_workdir",
                      help="checkpoints, metrics.jsonl and the plot; '' disables them")
  parser.add_argument("--save-every", type=integer_at_least(1), default=500,
                      help="steps between checkpoints")
  parser.add_argument("--seed", type=seed_type, default=0,
                      help="selects the source, the corpus and the initialisation")
  parser.add_argument("--learning-rate", type=positive_float, default=0.01,
                      help="dense Adam learning rate")
  parser.add_argument("--embedding-learning-rate", type=positive_float,
                      default=0.3, help="Adagrad learning rate of the embedding table")
  return parser


def parse_args(argv=None) -> argparse.Namespace:
  parser = build_parser()
  args = parser.parse_args(argv)
  processes = os.environ.get("JAX_NUM_PROCESSES", "").strip()
  if processes not in ("", "0", "1"):
    # Each process would train alone on the same workdir, and their saves collide.
    parser.error(f"this example runs in one process, but JAX_NUM_PROCESSES={processes} is set;"
                 " unset it (examples/dlrm.py shows a job of several processes)")
  if args.text is None:
    if args.vocab < 2:
      parser.error(f"--vocab must be at least 2, got {args.vocab}")
    if args.vocab > MAX_GENERATED_VOCAB:
      parser.error(f"--vocab must be at most {MAX_GENERATED_VOCAB} for the generated source"
                   f" (it draws a vocab^3 array: {args.vocab ** 3 * 8 / 2**30:.1f} GiB), got"
                   f" {args.vocab}; train on a larger vocabulary with --text")
    if args.successors > args.vocab:
      parser.error(f"--successors {args.successors} exceeds --vocab {args.vocab}")
    if args.corpus_tokens * EVAL_FRACTION <= args.seq_len + 1:
      parser.error(f"--corpus-tokens {args.corpus_tokens} is too short for --seq-len"
                   f" {args.seq_len}: its last {EVAL_FRACTION:.0%} (the evaluation part) needs"
                   " more than seq-len + 1 tokens")
  else:
    from etils import epath

    if not epath.Path(args.text).is_file():
      parser.error(f"--text {args.text!r} is not a readable file")
  return args


def load_corpus(args, parser_error) -> dict[str, Any]:
  """Tokens for training and evaluation, the vocabulary size and the entropy floor."""
  if args.text is None:
    source = MarkovSource(args.vocab, args.successors, args.seed)
    tokens = source.sample(args.corpus_tokens, args.seed)
    entropy = source.entropy_rate()
    vocab = args.vocab
    name = f"order-2 Markov source, {args.vocab} tokens, {args.successors} successors"
  else:
    try:
      tokens, vocabulary = text_tokens(args.text)
    except UnicodeDecodeError as error:
      parser_error(f"--text {args.text!r} is not UTF-8 text (byte {error.start}: {error.reason})")
    vocab, entropy, name = len(vocabulary), None, f"{args.text} ({len(vocabulary)} characters)"
    if tokens.size * EVAL_FRACTION <= args.seq_len + 1:
      parser_error(f"--text {args.text!r} holds {tokens.size} characters, too few for"
                   f" --seq-len {args.seq_len}")
  split = int(tokens.size * (1 - EVAL_FRACTION))
  return {"train": tokens[:split], "eval": tokens[split:], "vocab": vocab, "entropy": entropy,
          "name": name}


def main(argv=None) -> dict[str, Any]:
  parser = build_parser()
  args = parse_args(argv)
  import jax
  import optax

  from checkpoint import IncompatibleCheckpointError
  from pipelining import Trainer

  if args.batch_size % jax.device_count():
    parser.error(f"--batch-size {args.batch_size} is not a multiple of the"
                 f" {jax.device_count()} devices")
  corpus = load_corpus(args, parser.error)
  print(f"corpus: {corpus['name']}: {corpus['train'].size} training tokens,"
        f" {corpus['eval'].size} evaluation tokens", flush=True)
  if corpus["entropy"] is not None:
    print(f"source entropy rate {corpus['entropy']:.4f} nats/token: the best possible"
          f" perplexity is {math.exp(corpus['entropy']):.3f}", flush=True)
  specs = build_feature_specs(args.batch_size, args.seq_len, corpus["vocab"],
                              args.embedding_dim, args.embedding_learning_rate)
  workdir = args.workdir or None
  trainer = Trainer(
      build_model(corpus["vocab"], args.hidden), specs, cross_entropy,
      optax.adam(args.learning_rate), pipelining=args.pipelining, padding_id=PADDING_ID,
      workdir=workdir, save_every=args.save_every if workdir else None, seed=args.seed,
      host_memory="keep",  # this program only trains: let glibc reuse freed memory (CPU)
      log_every=50, eval_metrics=(),  # the loss is the metric: perplexity = exp(loss)
  )
  train = Windows(corpus["train"], args.batch_size, args.seq_len, seed=args.seed)
  evaluation = Windows(corpus["eval"], args.batch_size, args.seq_len, seed=args.seed + 10_000,
                       num_batches=args.eval_batches)
  try:
    # With checkpoints in the workdir, evaluate adopts the newest that restores
    # (one found damaged is skipped), the step fit then resumes from.
    before_loss = trainer.evaluate(evaluation)["loss"]
    before = math.exp(before_loss)
    start_step = int(trainer.state.step)
    if start_step:
      print(f"resuming from step {start_step}: perplexity {before:.3f}", flush=True)
    else:
      print(f"before training: perplexity {before:.3f} (uniform guess: {corpus['vocab']})",
            flush=True)
    started = time.perf_counter()
    history = trainer.fit(train, num_steps=start_step + args.steps)
    elapsed = time.perf_counter() - started
  except IncompatibleCheckpointError as error:  # flags other than the checkpoint's
    parser.error(
        f"--workdir {args.workdir} holds checkpoints written with other flags than these"
        f" (resume with those flags, or pass a new --workdir): {error}")
  # Nothing trained (--steps 0): the state evaluated before.
  trained_any = history.final_step > start_step
  after_loss = trainer.evaluate(evaluation)["loss"] if trained_any else before_loss
  after = math.exp(after_loss)
  print(f"after training: perplexity {after:.3f} (loss {after_loss:.4f} nats/token)", flush=True)
  trained = history.final_step - start_step
  entropy = corpus["entropy"]
  result = {
      "steps": history.final_step,
      "perplexity_before": round(before, 4),
      "perplexity_after": round(after, 4),
      "loss": round(after_loss, 5),
      "source_entropy": None if entropy is None else round(entropy, 5),
      "best_perplexity": None if entropy is None else round(math.exp(entropy), 4),
      "windows_per_sec": round(trained * args.batch_size / elapsed, 1) if trained else 0.0,
      "pipelining": args.pipelining,
  }
  if workdir and history.steps:
    from pipelining.plot import plot_workdir

    floor = None if corpus["entropy"] is None else ("source entropy rate (nats/token)",
                                                     corpus["entropy"])
    plot_path, _ = plot_workdir(workdir, loss_floor=floor)
    result["plot"] = str(plot_path)
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  # The repository root after site-packages: an installed sc-framework (with its built
  # kernels) comes first; a checkout without an install runs from its sources.
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  main()
