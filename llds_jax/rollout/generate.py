"""Generate mode: run the agent loop over questions and write full transcripts as JSONL.

One line per trajectory, in input order:
  {"uid", "id", "data_source", "question", "golden_answers",
   "prompt":  the prompt text as the model saw it (chat markers included),
   "turns":   [{"model": the kept model text, "action": "search" | "answer" | null, "content": the action content,
                "observation": the text appended after the turn or null, "observation_truncated": bool,
                "search_error": str or null, "hit_stop": bool}, ...],
   "answer":  the final answer (last <answer> of the model text) or null, "score": exact match (0.0 / 1.0),
   "end_reason": "answer" | "max_turns" | "context_full", "response_tokens": int}
"""
from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from typing import Any, Optional

import jax

from llds_jax.data.qa import QAExample
from llds_jax.rollout.agent import AgentConfig, Rollout, rollout
from llds_jax.rollout.trajectory import Trajectory


def transcript(trajectory: Trajectory, tokenizer) -> dict[str, Any]:
    """The JSON-ready transcript of one trajectory (see the module docstring)."""
    ex = trajectory.example
    return {
        "uid": ex.uid, "id": ex.id, "data_source": ex.data_source, "question": ex.question,
        "golden_answers": list(ex.golden_answers),
        "prompt": tokenizer.decode(list(trajectory.prompt_ids)),
        "turns": [{
            "model": tokenizer.decode(list(turn.token_ids), skip_special_tokens=True),
            "action": turn.action.kind, "content": turn.action.content, "observation": turn.observation,
            "observation_truncated": turn.observation_truncated, "search_error": turn.search_error,
            "hit_stop": turn.hit_stop,
        } for turn in trajectory.turns],
        "answer": trajectory.final_answer, "score": trajectory.reward, "end_reason": trajectory.end_reason,
        "response_tokens": trajectory.response_length,
    }


def generate(sampler, params, tokenizer, retriever, examples: Sequence[QAExample], rng: jax.Array,
             config: AgentConfig, out_path: str | os.PathLike,
             runner: Optional[asyncio.Runner] = None) -> Rollout:
    """Runs `agent.rollout` over `examples`, writes one transcript per line to `out_path`, returns the Rollout.

    The metrics gain `em/{data_source}` (mean exact match per source).
    """
    result = rollout(sampler, params, tokenizer, retriever, examples, rng, config, runner=runner)
    out_dir = os.path.dirname(os.fspath(out_path))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        for trajectory in result.trajectories:
            f.write(json.dumps(transcript(trajectory, tokenizer), ensure_ascii=False) + "\n")
    by_source: dict[str, list[float]] = {}
    for trajectory in result.trajectories:
        by_source.setdefault(trajectory.example.data_source, []).append(trajectory.reward)
    for source, scores in sorted(by_source.items()):
        result.metrics[f"em/{source}"] = sum(scores) / len(scores)
    return result
