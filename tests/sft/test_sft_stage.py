"""The supervised warm start: demonstration records (format, errors, encoding), the masked NLL it minimizes (exact
against NumPy), batching, and the cached stage end to end on a tiny generated world."""
import json
import os

import numpy as np
import pytest
from flax import nnx

from llds_jax.apps import demo
from llds_jax.model import ModelConfig, Transformer, hf_io
from llds_jax import protocol
from llds_jax.sft import demonstrations as demos_lib
from llds_jax import config as config_lib
from llds_jax.sft import stage
from llds_jax.sft.demonstrations import read_demonstrations
from llds_jax.model.tokenizer import load_tokenizer
from llds_jax.config.sections import RolloutConfig

PROMPT_TOKENS = RolloutConfig.max_prompt_tokens  # the run's default prompt cut

RECORD = {"question": "Where was Tova Ren born?",
          "turns": [{"text": "<think> search </think>\n<search> Tova Ren </search>",
                     "observation": "\n\n<information>Doc 1(Title: \"Tova Ren\") born in Veltra.</information>\n\n"},
                    {"text": "<think> found </think>\n<answer> Veltra </answer>"}],
          "score": 1.0}


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("line, message", [
    ("{not json", "invalid JSON"),
    ('["a"]', "expected a JSON object"),
    ('{"turns": [{"text": "x"}]}', "missing key 'question'"),
    ('{"question": "q", "turns": []}', "key 'turns' is empty"),
    ('{"question": "q", "turns": [{"observation": "o"}]}', r"turns\[0\]: missing key 'text'"),
    ('{"question": "q", "turns": [{"text": "t", "observation": 3}]}', "key 'observation' must be str, got int"),
    ('{"question": "q", "turns": [{"text": "t"}], "score": "high"}', "key 'score' must be float"),
])
def test_bad_records_name_file_line_and_key(tmp_path, line, message):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(RECORD), line])
    with pytest.raises(ValueError, match=f"d.jsonl:2: .*{message}"):
        demos_lib.read_demonstrations([path])


def test_min_score_filter_and_missing_file(tmp_path):
    low = dict(RECORD, score=0.0)
    unscored = {k: v for k, v in RECORD.items() if k != "score"}
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(r) for r in (RECORD, low, unscored)])
    assert len(demos_lib.read_demonstrations([path])) == 3
    assert [d.score for d in demos_lib.read_demonstrations([path], min_score=0.5)] == [1.0]
    with pytest.raises(ValueError, match="score >= 2"):
        demos_lib.read_demonstrations([path], min_score=2)
    with pytest.raises(FileNotFoundError, match="nothing.jsonl"):
        demos_lib.read_demonstrations([str(tmp_path / "nothing.jsonl")])


def test_encode_lays_out_prompt_turns_and_observations(qwen_tokenizer):
    demo = demos_lib.parse_record("r", RECORD)
    tokens, mask = demos_lib.encode(demo, qwen_tokenizer, max_prompt_tokens=4096)
    enc = lambda text: qwen_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = protocol.chat_prompt_ids(qwen_tokenizer, RECORD["question"], PROMPT_TOKENS)
    turns = RECORD["turns"]
    t0, o0, t1 = enc(turns[0]["text"]), enc(turns[0]["observation"]), enc(turns[1]["text"])
    assert tokens.tolist() == prompt + t0 + o0 + t1
    assert mask.tolist() == [0.0] * len(prompt) + [1.0] * len(t0) + [0.0] * len(o0) + [1.0] * len(t1)


def test_batches_group_by_length_pad_to_bucket_and_cycle_deterministically():
    encoded = [(np.arange(1, n + 1, dtype=np.int32), np.ones(n, np.float32)) for n in (3, 5, 9, 17, 2, 30)]
    a, b = (stage.Batches(encoded, 2, 4, pad_id=0, seed=1, group=3) for _ in range(2))
    seen = []
    for _ in range(3):
        batch = next(a)
        assert np.array_equal(batch["tokens_bt"], next(b)["tokens_bt"])
        lengths = batch["mask_bt"].sum(1).astype(int)
        assert batch["tokens_bt"].shape[1] == -(-max(lengths) // 4) * 4
        for row, n in zip(batch["tokens_bt"], lengths):
            assert row[:n].tolist() == list(range(1, n + 1)) and not row[n:].any()
        assert np.array_equal(batch["loss_mask_bt"], batch["mask_bt"])
        seen.append(sorted(lengths.tolist()))
    # One full pass before any repeat, cut into batches of neighbouring lengths.
    assert sorted(seen) == [[2, 3], [5, 9], [17, 30]]


def test_curriculum_serves_its_first_batches_then_the_rest():
    first = [(np.full(n, 7, np.int32), np.ones(n, np.float32)) for n in (3, 4)]
    rest = [(np.full(n, 9, np.int32), np.ones(n, np.float32)) for n in (5, 6)]
    batches = stage.curriculum(stage.Batches(first, 1, 4, 0, seed=0), 3, stage.Batches(rest, 1, 4, 0, seed=0))
    assert [int(next(batches)["tokens_bt"][0, 0]) for _ in range(6)] == [7, 7, 7, 9, 9, 9]
    with pytest.raises(ValueError, match="curriculum_files is empty"):
        stage.SFTConfig(data_files=("a",), output_dir="o", curriculum_steps=2).check_runnable()
    with pytest.raises(ValueError, match=r"sft.curriculum_steps \(300\) must be at most sft.steps \(200\)"):
        stage.SFTConfig(data_files=("a",), output_dir="o", curriculum_files=("b",), curriculum_steps=300)


@pytest.mark.slow
def test_train_minimizes_the_masked_nll_of_model_turns():
    cfg_m = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    model = Transformer(cfg_m, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    encoded = []
    for n in (20, 27, 31, 16):
        tokens = rng.integers(1, 64, n).astype(np.int32)
        mask = (rng.random(n) < 0.5).astype(np.float32)
        mask[0] = 0.0
        encoded.append((tokens, mask))
    batch = next(stage.Batches(encoded, 4, 8, pad_id=0, seed=0, group=1))
    # Independent formula: log-softmax of the model's own logits, NLL averaged over loss-mask tokens.
    logits = np.asarray(model(batch["tokens_bt"], batch["mask_bt"]), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    target_logp = np.take_along_axis(logp[:, :-1], batch["tokens_bt"][:, 1:, None], -1)[..., 0]
    weight = batch["loss_mask_bt"][:, 1:]
    expected = -(target_logp * weight).sum() / weight.sum()
    cfg = stage.SFTConfig(data_files=("unused",), output_dir="unused", steps=60, batch_size=4, learning_rate=1e-2,
                          warmup_steps=0, sequence_bucket=8, logp_time_chunk=16, log_every=1)
    records = stage.train(model, stage.Batches(encoded, 4, 8, pad_id=0, seed=0, group=1), cfg)
    assert len(records) == 60 and records[-1]["step"] == 60
    assert records[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert records[-1]["loss"] < 0.2 * records[0]["loss"]  # memorizes the four sequences' masked tokens


@pytest.mark.slow
def test_warm_start_writes_a_folder_and_is_cached(world_demo, tmp_path, capsys):
    cfg = world_demo(tmp_path / "run")
    assert cfg.sft.data_files and cfg.sft.data_files[0].endswith("demonstrations.jsonl")
    out = stage.warm_start(config_lib.typed(cfg))
    assert out == str(tmp_path / "run" / "warm_start")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", stage.DONE_FILE):
        assert os.path.exists(os.path.join(out, name)), name
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
    weights = os.path.getmtime(os.path.join(out, "model.safetensors"))
    capsys.readouterr()
    assert stage.warm_start(config_lib.typed(world_demo(tmp_path / "run"))) == out
    assert "reusing" in capsys.readouterr().out
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == weights
    changed = world_demo(tmp_path / "run")
    changed.sft.steps = 4  # another setting, another fingerprint: trained again
    model = changed.model
    overrides = {"dtype": model.dtype, "param_dtype": model.param_dtype, "scan_layers": model.scan_layers,
                 "remat": model.remat}
    with open(os.path.join(out, stage.DONE_FILE)) as f:
        recorded = json.load(f)["fingerprint"]
    path = cfg.model.path
    assert stage.fingerprint(stage.sft_config(config_lib.typed(cfg)), path, path, overrides) == recorded
    assert stage.fingerprint(stage.sft_config(config_lib.typed(changed)), path, path, overrides) != recorded


@pytest.mark.slow
def test_warm_start_from_and_to_gcs(world_demo, tmp_path, gcs_dir, gcs_fs, capsys):
    cfg = world_demo(f"{gcs_dir}/run")  # assets (and their embedded index) stay local
    gcs_fs.put(cfg.model.path, f"{gcs_dir}/model", recursive=True)
    gcs_fs.put(cfg.sft.data_files[0], f"{gcs_dir}/demonstrations.jsonl")
    local_model = cfg.model.path
    cfg.model.path, cfg.sft.data_files = f"{gcs_dir}/model", [f"{gcs_dir}/demonstrations.jsonl"]
    out = stage.warm_start(config_lib.typed(cfg))
    assert out == f"{gcs_dir}/run/warm_start"
    written = set(listed(gcs_fs, out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "metrics.jsonl",
            stage.DONE_FILE} <= written
    records = [json.loads(line) for line in gcs_fs.cat(f"{out}/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert json.loads(gcs_fs.cat(f"{out}/{stage.DONE_FILE}"))["final_loss"] == records[-1]["loss"]
    text = protocol.make_prompt("Where was Tova Ren born?")
    assert load_tokenizer(out).encode(text) == load_tokenizer(local_model).encode(text)
    trained, start = hf_io.load_model(out), hf_io.load_model(local_model)
    assert trained.cfg == start.cfg
    assert not np.array_equal(np.asarray(trained.embed[...]), np.asarray(start.embed[...]))
    capsys.readouterr()
    assert stage.warm_start(config_lib.typed(cfg)) == out
    assert "reusing" in capsys.readouterr().out


def listed(gcs_fs, folder):
    """Names of the objects directly in a gs:// folder."""
    return [path.rsplit("/", 1)[1] for path in gcs_fs.ls(folder, refresh=True)]


@pytest.mark.slow
def test_warm_start_curriculum_reads_the_searching_demonstrations_first(world_demo, tmp_path, capsys):
    cfg = world_demo(tmp_path / "run")
    cfg.sft.curriculum_steps = 2
    demo.prepare(cfg)  # the demo points the curriculum at its demonstrations that all search
    (files,) = cfg.sft.curriculum_files
    searching = read_demonstrations([files])
    assert files.endswith("search_demonstrations.jsonl") and all(len(d.turns) > 1 for d in searching)
    out = stage.warm_start(config_lib.typed(cfg))
    printed = capsys.readouterr().out
    assert f"2 steps of 8 on {len(searching)} demonstrations from {files}, then" in printed
    assert "1 steps of 8 on" in printed
    with open(os.path.join(out, stage.DONE_FILE)) as f:
        summary = json.load(f)
    assert summary["curriculum_steps"] == 2 and summary["curriculum_demonstrations"] == len(searching)
    plain = world_demo(tmp_path / "plain")
    assert stage.fingerprint(stage.sft_config(config_lib.typed(plain)), plain.model.path, plain.model.path, {}) != \
        stage.fingerprint(stage.sft_config(config_lib.typed(cfg)), cfg.model.path, cfg.model.path, {})
