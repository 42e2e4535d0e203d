"""The final answer is the last `<answer>...</answer>` complete inside one model turn: an answer opened in one turn
and closed in the next (here after the invalid-action message) scores 0, as in Search-R1, and the answer mask
covers the in-turn answer's tokens only."""
import numpy as np

from llds_jax.data.qa import QAExample
from llds_jax.data.rewards import em_reward
from llds_jax import protocol
from llds_jax.rollout.trajectory import Lineage, Turn, build_trajectory, em_score
from llds_jax.config.sections import RolloutConfig

PROMPT_TOKENS = RolloutConfig.max_prompt_tokens  # the run's default prompt cut

HAMLET = QAExample(uid="nq-0", question="who wrote hamlet", golden_answers=("William Shakespeare",), data_source="nq")


def turn(tokenizer, text, observation=None):
    """A model turn of `text` (its tokens kept whole) followed by `observation` (None: the last turn)."""
    ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    observation_ids = () if observation is None else tuple(tokenizer.encode(observation, add_special_tokens=False))
    return Turn(token_ids=ids, logps=(-0.5,) * len(ids), text=text, action=protocol.parse_action(text),
                num_sampled=len(ids), observation=observation, observation_ids=observation_ids)


def trajectory(tokenizer, turns, end_reason):
    prompt_ids = protocol.chat_prompt_ids(tokenizer, HAMLET.question, PROMPT_TOKENS)
    return build_trajectory(HAMLET, prompt_ids, turns, end_reason, tokenizer, Lineage(0, 0, (0, 0)))


def test_answer_split_across_turns_scores_zero_and_masks_nothing_a_later_one_counts(qwen_tokenizer):
    tok = qwen_tokenizer
    cut_by_token_limit = turn(tok, "<think>I know it.</think>\n<answer>Will", protocol.INVALID_ACTION_MESSAGE)
    split = trajectory(tok, [cut_by_token_limit, turn(tok, "iam Shakespeare</answer>")], "max_turns")
    assert [t.action.kind for t in split.turns] == [None, None]
    # Joined without the observation the model text holds a right answer; it is not scored.
    assert "<answer>William Shakespeare</answer>" in split.model_text
    assert em_reward(split.model_text, HAMLET.golden_answers) == 1.0
    assert (split.final_answer, em_score(split), int(split.answer_mask.sum())) == (None, 0.0, 0)
    # A complete answer in a later turn is the final answer; the mask covers its tokens, in its turn.
    turns = [cut_by_token_limit, turn(tok, "iam Shakespeare</answer>", protocol.INVALID_ACTION_MESSAGE),
             turn(tok, "<answer> William Shakespeare </answer>")]
    traj = trajectory(tok, turns, "answer")
    assert (traj.final_answer, em_score(traj)) == ("William Shakespeare", 1.0)
    masked = np.flatnonzero(traj.answer_mask)
    assert set(traj.action_ids[masked].tolist()) == {2}  # the last turn's tokens only
    assert tok.decode(traj.tokens[masked].tolist()) == "<answer> William Shakespeare </answer>"
    assert np.all(np.diff(masked) == 1) and np.all(traj.loss_mask[masked] == 1)
