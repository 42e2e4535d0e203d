"""The supervised warm-start stage: next-token loss on the demonstrations' model turns, then a Hugging Face folder.

Config-driven (the run config's `sft` section) and cached: the output folder records a fingerprint of everything
that determines it (the sft settings, the starting checkpoint, the tokenizer, the demonstration files' contents);
a later run with the same fingerprint reuses the folder and goes straight to RL, and one with another fingerprint
is refused (issue 66: it trained over the cache, which the finished run of the first settings still names); a
folder the stage did not write is never written into (llds_jax.runtime.output_folder). Works for any checkpoint the
trainer loads (a cold start for a real model is the same call with its own demonstrations).

The loss is the mean negative log-likelihood over the model-turn tokens of a batch (observations and the prompt are
context only), computed with the chunked log-probs of the RL objective. Batches are drawn from shuffled passes over
the demonstrations, grouped by length and padded to a multiple of `sequence_bucket` tokens, so the step compiles
once per bucket.

A curriculum is optional: the first `curriculum_steps` steps draw from `curriculum_files` instead (for instance only
demonstrations that search, so the policy learns to copy names into queries and answers out of documents before it
sees the ones that guess), the rest from `data_files`; one learning-rate schedule spans both.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterator
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx

from llds_jax import parallel
from llds_jax.runtime import gcs, output_folder
from llds_jax.bounds import ConfigError
from llds_jax.config.sections import RunConfig, SFTConfig
from llds_jax.model import hf_io, run_overrides
from llds_jax.rl.logprobs import model_token_logp
from llds_jax.train.batching import round_up
from llds_jax.sft.demonstrations import Demonstration, encode, read_demonstrations
from llds_jax.model.tokenizer import load_tokenizer, save_tokenizer

log = logging.getLogger(__name__)
DONE_FILE = "warm_start.json"
METRICS_FILE = "metrics.jsonl"
RECORD_KEYS = {"step", "loss", "tokens_per_s", "learning_rate"}  # a line of METRICS_FILE (`train`'s records)
SUMMARY_KEYS = {"fingerprint", "steps", "final_loss", "source"}  # in every DONE_FILE the stage has written
# What a warm start writes: those two, hf_io.save_model's files (and shards, _SHARD) and the tokenizer's.
_OWN_FILES = frozenset({DONE_FILE, METRICS_FILE, "config.json", "generation_config.json", "model.safetensors",
                        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                        "chat_template.jinja", "special_tokens_map.json", "vocab.json", "merges.txt",
                        "added_tokens.json"})
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def schedule(cfg: SFTConfig) -> optax.Schedule:
    """Linear warmup from 0 to the peak over `warmup_steps`, then cosine decay to a tenth of it at `steps`."""
    return optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                              max(cfg.steps, cfg.warmup_steps + 1), cfg.learning_rate / 10)


def make_optimizer(cfg: SFTConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on `schedule`."""
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                       optax.adamw(schedule(cfg), weight_decay=cfg.weight_decay))


class Batches:
    """Padded batches from shuffled passes over encoded demonstrations (deterministic from the seed).

    Length-grouped: `group` batches' worth of demonstrations are drawn at a time, sorted by length and cut into
    batches (served in random order), so a batch pads to its own longest row, not to the longest of the data.
    """

    def __init__(self, encoded: list[tuple[np.ndarray, np.ndarray]], batch_size: int, bucket: int, pad_id: int,
                 seed: int, group: int = 8):
        self.encoded, self.batch_size, self.bucket, self.pad_id, self.group = encoded, batch_size, bucket, pad_id, group
        self.rng = np.random.default_rng(seed)
        self.order: list[int] = []
        self.ready: list[list[int]] = []

    def _draw(self) -> int:
        if not self.order:
            self.order = list(self.rng.permutation(len(self.encoded)))
        return self.order.pop()

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if not self.ready:
            drawn = sorted((self._draw() for _ in range(self.batch_size * self.group)),
                           key=lambda i: len(self.encoded[i][0]))
            self.ready = [drawn[i:i + self.batch_size] for i in range(0, len(drawn), self.batch_size)]
            self.ready = [self.ready[i] for i in self.rng.permutation(len(self.ready))]
        rows = [self.encoded[i] for i in self.ready.pop()]
        length = round_up(max(len(tokens) for tokens, _ in rows), self.bucket)
        tokens_bt = np.full((len(rows), length), self.pad_id, np.int32)
        mask_bt = np.zeros((len(rows), length), np.float32)
        loss_mask_bt = np.zeros((len(rows), length), np.float32)
        for i, (tokens, loss_mask) in enumerate(rows):
            tokens_bt[i, :len(tokens)] = tokens
            mask_bt[i, :len(tokens)] = 1.0
            loss_mask_bt[i, :len(tokens)] = loss_mask
        return {"tokens_bt": tokens_bt, "mask_bt": mask_bt, "loss_mask_bt": loss_mask_bt}


def curriculum(first: Optional[Batches], first_steps: int, rest: Batches) -> Iterator[dict[str, np.ndarray]]:
    """`first_steps` batches of `first`, then the batches of `rest`."""
    for _ in range(first_steps):
        yield next(first)
    yield from rest


def fingerprint(cfg: SFTConfig, model_path: str, tokenizer_path: str, model_overrides: dict) -> str:
    """sha256 over the settings, the starting checkpoint's and tokenizer's paths and the data files' bytes."""
    digest = hashlib.sha256()
    settings = dataclasses.asdict(cfg)
    for key in ("enabled", "log_every"):  # not what is trained
        settings.pop(key)
    digest.update(json.dumps([settings, model_path, tokenizer_path, model_overrides], sort_keys=True).encode())
    for path in cfg.data_files + (cfg.curriculum_files if cfg.curriculum_steps else ()):
        digest.update(epath.Path(path).read_bytes())
    return digest.hexdigest()


def recorded_fingerprint(done: epath.Path) -> str | None:
    """The fingerprint a finished warm start recorded in `done` (its DONE_FILE), or None when there is none. A file
    cut by a kill or a full disk as it was written (empty, torn JSON, not UTF-8) is warned about, naming it, and
    the warm start is redone (before: "Expecting value: line 1 column 1 (char 0)" on every rerun)."""
    if not done.exists():
        return None
    try:
        record = json.loads(done.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("warm start: %s is unreadable (%s): training the warm start again", done,
                    "empty" if isinstance(e, json.JSONDecodeError) and not e.doc.strip() else e)
        return None
    return record.get("fingerprint") if isinstance(record, dict) else None


def _summary(out_dir: str) -> dict | None:
    """The DONE_FILE of a local warm-start folder when it is one the stage wrote, else None."""
    record = output_folder.read_json(os.path.join(out_dir, DONE_FILE))
    return record if isinstance(record, dict) and SUMMARY_KEYS <= record.keys() else None


def _is_log(out_dir: str) -> bool:
    """Whether the folder's METRICS_FILE holds the warm start's records, and only them (an unfinished warm start)."""
    lines = output_folder.json_lines(os.path.join(out_dir, METRICS_FILE))
    return bool(lines) and all(isinstance(line, dict) and line.keys() == RECORD_KEYS for line in lines)


def _recorded(out_dir: str) -> dict | None:
    """The spec of the finished warm start a local folder holds (its fingerprint), or None."""
    summary = _summary(out_dir)
    return None if summary is None else {"fingerprint": summary["fingerprint"]}


# A warm-start folder of an older version (before the marker): its DONE_FILE, or a METRICS_FILE of the stage's
# records (an unfinished one), beside the files the stage writes.
WARM_START = output_folder.Kind(
    "warm start", recorded=_recorded,
    strangers=output_folder.proven_by(lambda out_dir: _summary(out_dir) is not None or _is_log(out_dir),
                                      lambda entry: entry in _OWN_FILES or bool(_SHARD.fullmatch(entry))))


@contextlib.contextmanager
def _no_step_left_running(in_flight):
    """On an exception (a stop signal's StopRequested among them), waits for the steps still queued
    (`in_flight()`: their losses; at most one) before it propagates: an exit with a step running crashed the
    interpreter's teardown (segmentation fault)."""
    try:
        yield
    except BaseException:
        jax.block_until_ready(in_flight())
        raise


def train(model: nnx.Module, batches: Iterator[dict[str, np.ndarray]], cfg: SFTConfig,
          mesh: Optional[jax.sharding.Mesh] = None, on_log=None) -> list[dict[str, float]]:
    """Runs `cfg.steps` supervised steps on `model` (its parameters are replaced in place).

    Returns the logged records ({"step", "loss", "tokens_per_s", "learning_rate"}, every `log_every` steps and
    the last); `on_log(record)` is called with each.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer, lr = make_optimizer(cfg), schedule(cfg)
    context = (lambda: jax.set_mesh(mesh)) if mesh is not None else contextlib.nullcontext

    def loss_fn(params, batch):
        logp_bt, _ = model_token_logp(nnx.merge(graphdef, params, rest), batch["tokens_bt"], batch["mask_bt"],
                                      time_chunk=cfg.logp_time_chunk, mesh=mesh)
        weight_bt = batch["loss_mask_bt"]
        return -jnp.sum(logp_bt * weight_bt) / jnp.maximum(jnp.sum(weight_bt), 1.0)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    sharding = parallel.batch_sharding(mesh, 2) if mesh is not None else None
    losses = []  # the losses of the steps since the last log line; the last one's step may still run
    with context(), _no_step_left_running(lambda: losses[-1:]):
        opt_state = jax.jit(optimizer.init)(params)
        records, losses, tokens, start = [], [], 0.0, time.perf_counter()
        for i in range(1, cfg.steps + 1):
            batch = next(batches)
            tokens += float(batch["mask_bt"].sum())
            params, opt_state, loss = step(params, opt_state, jax.device_put(batch, sharding))
            if losses:  # at most this step queued: a stop signal's handler runs (and stops) within a step's time;
                losses[-1].block_until_ready()  # a wait on log_every queued steps cannot be interrupted
            losses.append(loss)
            if i % cfg.log_every == 0 or i == cfg.steps:
                mean_loss = float(np.mean(jax.device_get(losses)))  # waits for the steps: times them
                elapsed = time.perf_counter() - start
                record = {"step": i, "loss": mean_loss, "tokens_per_s": tokens / elapsed,
                          "learning_rate": float(lr(i))}
                records.append(record)
                if on_log is not None:
                    on_log(record)
                losses, tokens, start = [], 0.0, time.perf_counter()
    nnx.update(model, params)
    return records


def sft_config(run: RunConfig) -> SFTConfig:
    """A run config's `sft` section as the stage takes it (with the run's prompt cut, log-prob chunk and seed), its
    output folder <run_dir>/warm_start when sft.output_dir is ""; ConfigError unless it can run
    (`SFTConfig.check_runnable`)."""
    sft = dataclasses.replace(run.sft, output_dir=run.sft.output_dir or f"{run.run_dir}/warm_start")
    sft.check_runnable()
    return sft


def encode_all(demos: list[Demonstration], tokenizer, cfg: SFTConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """Encoded demonstrations; those over `max_length` tokens are skipped with a warning naming the count."""
    encoded = [encode(demo, tokenizer, cfg.max_prompt_tokens) for demo in demos]
    kept = [pair for pair in encoded if len(pair[0]) <= cfg.max_length]
    if len(kept) < len(encoded):
        log.warning("sft: skipped %d of %d demonstrations longer than sft.max_length=%d tokens",
                    len(encoded) - len(kept), len(encoded), cfg.max_length)
    if not kept:
        raise ConfigError(f"sft: every demonstration is longer than sft.max_length={cfg.max_length} tokens")
    return kept


def _claim(out: epath.Path, key: str) -> None:
    """Makes `out` the warm start's folder for the fingerprint `key` before anything is loaded: a local folder of
    the user's own files (a metrics.jsonl or config.json of another tool), of another output, or of a finished
    warm start of another fingerprint is refused in one line, nothing in it written (llds_jax.runtime.output_folder);
    on gs://, which has no folders to mark, a finished warm start of another fingerprint is refused all the same."""
    if not gcs.is_gcs(str(out)):
        output_folder.claim(str(out), "sft.output_dir", WARM_START, {"fingerprint": key})
        return
    found = recorded_fingerprint(out / DONE_FILE)
    output_folder.check_settings(str(out), "sft.output_dir", None if found is None else {"fingerprint": found},
                                 {"fingerprint": key})


def warm_start(run: RunConfig) -> str:
    """Runs the run config's warm start (or reuses its cached output); returns the output folder.

    The folder holds the weights (safetensors), the tokenizer, `metrics.jsonl` (the logged records) and
    `warm_start.json` (the fingerprint and a summary), written last: a folder without it is redone. A folder that
    is not the stage's, or holds a finished warm start of another fingerprint, is refused before anything loads
    (FolderNotOursError naming sft.output_dir).
    """
    if jax.process_count() > 1:
        raise ConfigError("sft.enabled: the warm start runs in one process; run `--mode=sft` on one host, then "
                          "start the job with model.path set to its output and sft.enabled=False")
    s = sft_config(run)
    m = run.model
    tokenizer_path = m.tokenizer_path or m.path
    overrides = {"dtype": m.dtype, "param_dtype": m.param_dtype, "scan_layers": m.scan_layers, "remat": m.remat}
    key = fingerprint(s, m.path, tokenizer_path, overrides)
    out = epath.Path(s.output_dir)
    done = out / DONE_FILE
    _claim(out, key)
    if recorded_fingerprint(done) == key:
        print(f"warm start: reusing {out} (same settings, checkpoint and demonstrations)", flush=True)
        return str(out)
    tokenizer = load_tokenizer(tokenizer_path, fallback_chat_template=m.chat_template)
    min_score = None if s.min_score < 0 else s.min_score
    encoded = encode_all(read_demonstrations(s.data_files, min_score), tokenizer, s)
    first = (encode_all(read_demonstrations(s.curriculum_files, min_score), tokenizer, s)
             if s.curriculum_steps else [])
    mesh = parallel.make_mesh(run.mesh.data, run.mesh.fsdp, run.mesh.tensor)
    batch_shards = math.prod(mesh.shape[axis] for axis in parallel.BATCH)
    if s.batch_size % batch_shards:
        raise ConfigError(f"sft.batch_size ({s.batch_size}) must be a multiple of the mesh's batch axes "
                          f"data x fsdp = {batch_shards}")
    # The attention implementation and model.mlp_chunks are left out of the fingerprint: each computes the same
    # function.
    model = hf_io.load_model(m.path, mesh=mesh, **run_overrides(m))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if first:
        print(f"warm start: {s.curriculum_steps} steps of {s.batch_size} on {len(first)} demonstrations from "
              f"{', '.join(s.curriculum_files)}, then", flush=True)
    print(f"warm start: {s.steps - s.curriculum_steps} steps of {s.batch_size} on {len(encoded)} demonstrations "
          f"from {', '.join(s.data_files)}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with (out / METRICS_FILE).open("w") as f:
        def on_log(record):
            f.write(json.dumps(record) + "\n")
            print(f"warm start step {record['step']}/{s.steps}  loss {record['loss']:.4f}  "
                  f"{record['tokens_per_s']:.0f} tokens/s", flush=True)

        batches = curriculum(Batches(first, s.batch_size, s.sequence_bucket, pad_id, s.seed) if first else None,
                             s.curriculum_steps, Batches(encoded, s.batch_size, s.sequence_bucket, pad_id, s.seed))
        records = train(model, batches, s, mesh, on_log)
    hf_io.save_model(model, str(out), generation_config=hf_io.read_generation_config(m.path))
    save_tokenizer(tokenizer, str(out))
    summary = {"fingerprint": key, "steps": s.steps, "demonstrations": len(encoded),
               "curriculum_steps": s.curriculum_steps, "curriculum_demonstrations": len(first),
               "final_loss": records[-1]["loss"], "seconds": time.perf_counter() - start, "source": m.path}
    done.write_text(json.dumps(summary, indent=2))
    print(f"warm start: done in {summary['seconds']:.0f} s, final loss {summary['final_loss']:.4f}; "
          f"weights in {out}", flush=True)
    return str(out)
