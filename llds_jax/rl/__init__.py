"""GRPO + LLDS: advantages, chunked log-probs, loss terms, LLD diagnostics and the train step."""
from llds_jax.rl.advantages import grpo_advantages
from llds_jax.rl.config import LLDSConfig, ObjectiveConfig
from llds_jax.rl.logprobs import model_token_logp, token_logp_entropy
from llds_jax.rl.losses import objective_loss
from llds_jax.rl.terms import LossInputs, get_loss_term, register_loss_term
from llds_jax.rl.train_step import BatchMetrics, PreparedBatch, RLTrainStep, TrainState, UpdateConfig

__all__ = ["grpo_advantages", "LLDSConfig", "ObjectiveConfig", "model_token_logp", "token_logp_entropy",
           "objective_loss", "LossInputs", "get_loss_term", "register_loss_term", "BatchMetrics", "PreparedBatch",
           "RLTrainStep", "TrainState", "UpdateConfig"]
