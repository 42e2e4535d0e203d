"""Rollout engine benchmarks, printed as ratios.

1. Decode throughput: the rollout engine (ragged steps over a paged KV cache, chunked decode) against Hugging Face
   `transformers` `generate` (torch, CPU) on the same random weights and prompts, greedy, a fixed number of new
   tokens per row. Also prints how many greedy tokens agree (a check of the weight mapping).
2. Multi-turn: a conversation of N turns (decode a turn, append an observation) with observations appended to
   the paged KV cache (`Engine.extend`) against re-encoding the whole context at the start of every turn.
3. Continuous batching: the agent loop (`agent.rollout`, Qwen2.5 tokenizer) over the same model with continuous
   scheduling (`AgentConfig.continuous_batching`) against turn-synchronous sessions of --cb-rows sequences, sampled
   (temperature 1) from the same PRNG streams, so both sample the same tokens. The random model writes no action:
   every turn gets the invalid-action message as its observation, and a turn ends at a "stop token" (every
   --cb-stop-every-th vocabulary id: turns of varied lengths) or at --cb-turn-tokens. Prints the decode-row
   occupancy (sampled tokens / (decode steps x device rows)) and the sampled tokens per second of rollout of each,
   and their ratios.

Both sides are warmed up (compiled) before timing. Example:
    python bench/rollout.py --batch 16 --new-tokens 128
    python bench/rollout.py --only-continuous --cb-sequences 64 --cb-rows 16
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from llds_jax.model import tokenizer as tokenizer_lib
from llds_jax.data.qa import QAExample
from llds_jax.model import ModelConfig, Transformer, hf_io, to_hf_config
from llds_jax.rollout import agent
from llds_jax.rollout.config import AgentConfig, SamplingConfig
from llds_jax.rollout.driver import sequence_keys
from llds_jax.rollout.engine import Engine, EngineConfig
from llds_jax.rollout.paged_sampler import PagedSampler, engine_config, token_budgets
from llds_jax.rollout.runner import DeviceRunner
from llds_jax.search.types import Retriever


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The random model's shape (`model_config`): a 42.8M-parameter Qwen2 with its 151,936-token vocabulary."""
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--decode-chunk", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--obs-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per side (the best is reported)")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument("--only-continuous", action="store_true", help="run the continuous-batching comparison only")
    p.add_argument("--cb-sequences", type=int, default=32, help="continuous batching: sequences of the rollout")
    p.add_argument("--cb-rows", type=int, default=8, help="continuous batching: rows (agent max_batch_size)")
    p.add_argument("--cb-turns", type=int, default=3, help="continuous batching: agent max_turns")
    p.add_argument("--cb-turn-tokens", type=int, default=48, help="continuous batching: agent max_turn_tokens")
    p.add_argument("--cb-stop-every", type=int, default=12, help="continuous batching: every this many vocabulary "
                   "ids is a stop token (a turn's expected length)")
    p.add_argument("--cb-decode-chunk", type=int, default=8, help="continuous batching: decode steps per chunk")
    p.add_argument("--hf-device", default="cpu", help="torch device of the transformers model (cpu, cuda)")
    return p.parse_args()


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                       head_dim=args.head_dim, rope_theta=1_000_000.0, qkv_bias=True, tie_word_embeddings=True)


def best_time(fn, repeats: int) -> tuple[float, object]:
    """Runs fn once to warm up, then `repeats` times; returns (best seconds, last result)."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


class Engines:
    """Opens rollout engines of `rows` sequence slots and contexts up to `max_context` tokens over one compiled
    runner (`rollout.runner.DeviceRunner`), every sequence sampling from its key of PRNG key 0."""

    def __init__(self, graphdef, cfg: ModelConfig, sampling: SamplingConfig, rows: int, max_context: int,
                 max_step_tokens: int = 512, page_size: int = 16, mesh=None):
        self.shapes = EngineConfig(max_seqs=rows, token_budgets=token_budgets(rows, max(max_step_tokens, rows)),
                                   decode_chunk=sampling.decode_chunk, page_size=page_size,
                                   num_pages=rows * -(-max_context // page_size) + 1, max_context=max_context,
                                   stop_ids=sampling.stop_ids)
        self.runner = DeviceRunner(graphdef, cfg, sampling, self.shapes, mesh)
        self.keys = sequence_keys(jax.random.key(0), range(rows))

    def turns(self, params, prompts, new_tokens) -> list[list[int]]:
        """One turn of up to `new_tokens` tokens of each prompt in a fresh engine."""
        engine = Engine(self.runner, params, self.shapes)
        for seq, prompt in enumerate(prompts):
            engine.add_request(seq, prompt, self.keys[seq], new_tokens)
        return [turn.token_ids for _, turn in sorted(run_turns(engine).items())]


def run_turns(engine: Engine) -> dict:
    """Steps until every running sequence's turn has ended; seq -> its turn."""
    ended = {}
    while engine.running:
        ended.update(engine.step())
    return ended


def hf_model(cfg: ModelConfig, params, device: str):
    """A transformers Qwen2ForCausalLM holding our weights (names and layouts of the library's export,
    `hf_io.hf_state_dict`)."""
    import torch
    import transformers

    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**to_hf_config(cfg))).eval()
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    nnx.update(model, params)
    missing, unexpected = hf.load_state_dict({name: torch.from_numpy(array)
                                              for name, array in hf_io.hf_state_dict(model)}, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping: missing {missing}, unexpected {unexpected}")
    return hf.to(device)


def decode_hf(hf, prompts, new_tokens) -> list[list[int]]:
    import torch

    length = max(map(len, prompts))
    ids = torch.zeros((len(prompts), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):  # left padding, as for our prefill
        ids[i, length - len(prompt):] = torch.tensor(prompt)
        mask[i, length - len(prompt):] = 1
    ids, mask = ids.to(hf.device), mask.to(hf.device)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    if out.is_cuda:
        torch.cuda.synchronize()
    return out[:, length:].tolist()


def conversation_extend(engines: Engines, params, prompts, observations, turn_tokens) -> list[list[int]]:
    """N turns in one engine: observations appended to the paged KV cache."""
    engine = Engine(engines.runner, params, engines.shapes)
    for seq, prompt in enumerate(prompts):
        engine.add_request(seq, prompt, engines.keys[seq], turn_tokens)
    tokens = [[] for _ in prompts]
    for turn, obs in enumerate(observations):
        for seq, t in run_turns(engine).items():
            tokens[seq] += t.token_ids
            if turn + 1 < len(observations):
                engine.extend(seq, len(t.token_ids), obs[seq], turn_tokens)
    return tokens


def conversation_reencode(engines: Engines, params, prompts, observations, turn_tokens) -> list[list[int]]:
    """The same conversation, re-encoding prompt + all previous turns and observations every turn."""
    contexts = [list(p) for p in prompts]
    tokens = [[] for _ in prompts]
    for obs in observations:
        for row, turn in enumerate(engines.turns(params, contexts, turn_tokens)):
            tokens[row] += turn
            contexts[row] += turn + obs[row]
    return tokens


def main() -> None:
    args = parse_args()
    cfg = model_config(args)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    max_context = args.prompt_len + max(args.new_tokens, args.turns * (args.turn_tokens + args.obs_tokens)) + 1
    engines = Engines(graphdef, cfg, SamplingConfig(greedy=True, decode_chunk=args.decode_chunk), args.batch,
                      max_context)
    rs = np.random.RandomState(0)
    top_id = min(cfg.vocab_size, 151643)  # ordinary (non-special) Qwen2.5 token ids
    prompts = [rs.randint(0, top_id, size=args.prompt_len - (i % 8)).tolist()
               for i in range(args.batch)]
    print(f"model: {cfg.num_params() / 1e6:.1f}M parameters ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}); batch {args.batch}, prompts {min(map(len, prompts))}-{args.prompt_len} tokens; "
          f"devices: {jax.devices()[0].platform} x{jax.device_count()}")

    if args.only_continuous:
        continuous_batching(args, graphdef, params)
        return
    new = args.new_tokens * args.batch
    ours_s, ours_tokens = best_time(lambda: engines.turns(params, prompts, args.new_tokens), args.repeats)
    print(f"[decode] llds_jax rollout engine: {ours_s:.2f} s, {new / ours_s:.0f} tokens/s")
    if not args.skip_hf:
        import torch

        hf = hf_model(cfg, params, args.hf_device)
        hf_s, hf_tokens = best_time(lambda: decode_hf(hf, prompts, args.new_tokens), args.repeats)
        agree = np.mean([a == b for x, y in zip(ours_tokens, hf_tokens) for a, b in zip(x, y)])
        first = np.mean([x[0] == y[0] for x, y in zip(ours_tokens, hf_tokens)])
        where = args.hf_device if args.hf_device != "cpu" else f"cpu, {torch.get_num_threads()} threads"
        print(f"[decode] transformers generate (torch {torch.__version__}, {where}): "
              f"{hf_s:.2f} s, {new / hf_s:.0f} tokens/s")
        print(f"[decode] greedy agreement with transformers: first token {first:.0%}, all tokens {agree:.0%}")
        print(f"[decode] speed ratio llds_jax / transformers: {hf_s / ours_s:.2f}x")

    observations = [[rs.randint(0, top_id, size=args.obs_tokens - (row % 4)).tolist() for row in range(args.batch)]
                    for _ in range(args.turns)]
    run = lambda fn: fn(engines, params, prompts, observations, args.turn_tokens)
    ext_s, ext_tokens = best_time(lambda: run(conversation_extend), args.repeats)
    re_s, re_tokens = best_time(lambda: run(conversation_reencode), args.repeats)
    same = np.mean([a == b for x, y in zip(ext_tokens, re_tokens) for a, b in zip(x, y)])
    print(f"[multi-turn] {args.turns} turns x {args.turn_tokens} tokens, observations of ~{args.obs_tokens} tokens: "
          f"KV-cache extend {ext_s:.2f} s, re-encode every turn {re_s:.2f} s; ratio {re_s / ext_s:.2f}x "
          f"(greedy tokens identical: {same:.0%})")
    continuous_batching(args, graphdef, params)


class NoRetriever(Retriever):
    """A retriever that is never asked (the random model writes no search)."""

    backend = "none"

    async def search(self, queries, k):
        raise RuntimeError("NoRetriever: no search expected")

    async def check(self):
        pass

    async def close(self):
        pass


def continuous_batching(args, graphdef, params) -> None:
    """Section 3: the agent loop with continuous batching against sessions (see the module docstring)."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = tokenizer_lib.load_tokenizer(tokenizer_lib.write_qwen25_tokenizer(folder, "base"))
    stop_ids = tuple(range(0, min(args.vocab, 151643), args.cb_stop_every))
    sampling = SamplingConfig(temperature=1.0, decode_chunk=args.cb_decode_chunk, stop_ids=stop_ids)
    examples = [QAExample(uid=f"q{i}", question="which city is it " + "really " * (i % 5), golden_answers=("x",),
                          data_source="bench") for i in range(args.cb_sequences)]
    base = AgentConfig(max_turns=args.cb_turns, max_turn_tokens=args.cb_turn_tokens, max_batch_size=args.cb_rows)
    results = {}
    for name, continuous in (("sessions", False), ("continuous", True)):
        config = dataclasses.replace(base, continuous_batching=continuous)
        sampler = PagedSampler(graphdef, model_config(args), sampling, engine_config(config, sampling, args.cb_rows,
                                                                                     16, 512))
        request = agent.RolloutRequest(examples, jax.random.key(1), config)
        run = lambda: agent.rollout(sampler, params, tokenizer, NoRetriever(), request)  # noqa: E731
        run()  # compiles
        result = min((run() for _ in range(max(args.repeats, 1))), key=lambda r: r.metrics["rollout_s"])
        m = result.metrics
        results[name] = (m["decode_occupancy"], m["sampled_tokens"] / m["rollout_s"], result)
        print(f"[continuous] {name:<10}: decode occupancy {m['decode_occupancy']:.1%}, {m['sampled_tokens']:.0f} "
              f"sampled tokens in {m['rollout_s']:.2f} s: {m['sampled_tokens'] / m['rollout_s']:.0f} tokens/s "
              f"(engine steps {m['decode_s']:.2f} s)")
    (occ_s, tps_s, sessions), (occ_c, tps_c, continuous) = results["sessions"], results["continuous"]
    # The same streams; a near-uniform distribution over the whole vocabulary (a random model) can still draw
    # another token from logits that differ at float rounding (prompts chunked differently).
    same = sum(np.array_equal(a.tokens, b.tokens) for a, b in zip(sessions.trajectories, continuous.trajectories))
    print(f"[continuous] {args.cb_sequences} sequences, {args.cb_rows} rows, up to {args.cb_turns + 1} turns of "
          f"<= {args.cb_turn_tokens} tokens: continuous / sessions occupancy {occ_c / occ_s:.2f}x, tokens/s "
          f"{tps_c / tps_s:.2f}x (trajectories with the same tokens: {same}/{args.cb_sequences})")


if __name__ == "__main__":
    main()
