"""The run folder's config record (llds_jax.train.run_config): what a resume with another config keeps and says."""
import json

import ml_collections
from etils import epath

from llds_jax import config as config_lib
from llds_jax import launch
from llds_jax.train import run_config
from tests.configs import load


def test_a_resume_with_changed_keys_keeps_the_earlier_config_and_names_the_changes(tmp_path):
    run_dir = epath.Path(tmp_path)
    cfg = load("tiny_test")
    assert run_config.record(run_dir, config_lib.as_json(cfg), 0) == []  # a fresh run
    assert run_config.record(run_dir, config_lib.as_json(cfg), 3) == []  # the same config: nothing kept, nothing said
    assert not (run_dir / "config.before-step-3.json").exists()
    changed = load("tiny_test")
    changed.train.total_steps, changed.optim.learning_rate = 40, 0.5
    changed.distributed.num_processes = 7  # where the run executes: not compared
    found = run_config.record(run_dir, config_lib.as_json(changed), 3)
    assert found == [f"optim.learning_rate: {json.dumps(cfg.optim.learning_rate)} -> 0.5",
                     f"train.total_steps: {cfg.train.total_steps} -> 40"]
    assert json.loads((run_dir / "config.before-step-3.json").read_text())["train"]["total_steps"] == \
        cfg.train.total_steps
    assert json.loads((run_dir / "config.json").read_text())["train"]["total_steps"] == 40
    line = run_config.notice(run_dir, 3, found)
    assert line.startswith(f"llds_jax: resuming {run_dir} from step 3 with 2 changed config key(s): "
                           f"optim.learning_rate: ")


def test_changes_name_added_and_removed_keys_and_count_past_five():
    found = run_config.changes({"a": {"x": 1, "gone": "v"}}, {"a": {"x": 1, "new": [1, 2]}})
    assert found == ['a.gone: "v" -> (none)', "a.new: (none) -> [1, 2]"]
    many = [f"k{i}: 0 -> 1" for i in range(7)]
    assert run_config.notice(epath.Path("/r"), 2, many).split(": ", 1)[1].startswith(
        "resuming /r from step 2 with 7 changed config key(s): k0: 0 -> 1; k1")
    assert "; and 2 more (the earlier config" in run_config.notice(epath.Path("/r"), 2, many)


def test_what_a_run_trains_on_leaves_out_how_the_retriever_is_reached():
    """A resume may reach its retriever at another address, with other retries or batches (issue 66's check would
    refuse a stopped run resumed with a retry policy given where the defaults were); another index is another run."""
    cfg = load("tiny_test")
    cfg.demo.enabled = False  # the demo would provide the retriever section itself
    cfg.retriever = ml_collections.ConfigDict({"backend": "http", "url": "http://127.0.0.1:1/retrieve"})
    before = launch.trained_on(config_lib.as_json(cfg), cfg)
    cfg.retriever = ml_collections.ConfigDict({"backend": "http", "url": "http://10.0.0.2:8000/retrieve",
                                               "max_retries": 0, "timeout_s": 5.0, "batch_size": 16})
    assert launch.trained_on(config_lib.as_json(cfg), cfg) == before
    assert before["retriever.backend"] == "http" and "retriever.url" not in before
    cfg.retriever = ml_collections.ConfigDict({"backend": "bm25", "index_dir": "/index"})
    changed = launch.trained_on(config_lib.as_json(cfg), cfg)
    assert (changed["retriever.backend"], changed["retriever.index_dir"]) == ("bm25", "/index")
