"""Shipped configs pass the schema and validation; schema and combination errors name the key."""
import glob
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from llds_jax import application, checks, topologies
from llds_jax import config as config_lib
from llds_jax.config import loader
from llds_jax.data.rewards import em_reward
from llds_jax.train import run_config
from tests.configs import CONFIGS, load

ROOT = os.path.dirname(CONFIGS)

# Devices of the slice each TPU config is written for (v4-32: 16 chips, v4-16: 8, v5p-16: 8, v6e-16: 16).
TPU_DEVICES = {"qwen7b_v4": 16, "qwen7b_instruct_v4": 16, "grpo_baseline_v4": 16, "qwen3b_v4": 8,
               "qwen3b_base_ma_v4": 8, "llama3b_v4": 8, "qwen7b_v5p": 8, "qwen7b_v6e": 16, "qwen7b_deep_v4": 16}
PRESETS = {"qwen7b_v4": "qwen2.5-7b", "qwen7b_instruct_v4": "qwen2.5-7b", "grpo_baseline_v4": "qwen2.5-7b",
           "qwen3b_v4": "qwen2.5-3b", "qwen3b_base_ma_v4": "qwen2.5-3b", "llama3b_v4": "llama-3.2-3b",
           "qwen7b_v5p": "qwen2.5-7b", "qwen7b_v6e": "qwen2.5-7b", "qwen7b_deep_v4": "qwen2.5-7b"}


def test_every_config_file_is_covered():
    names = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(CONFIGS, "*.py"))} - {"__init__"}
    assert names == set(TPU_DEVICES) | {"base", "demo_cpu", "demo_cpu_grpo", "demo_cpu_paper",
                                                 "demo_cpu_collapse", "demo_cpu_late_collapse", "demo_cpu_late_study",
                                                 "demo_cpu_long_horizon", "demo_cpu_tree_study", "demo_cpu_deep",
                                                 "tiny_test"}


@pytest.mark.parametrize("name", sorted(TPU_DEVICES))
def test_tpu_configs_validate_on_their_slice(name):
    cfg = load(name)
    checks.validate(cfg, TPU_DEVICES[name])
    assert topologies.chips(cfg.mesh.topology) == TPU_DEVICES[name]  # the slice --mode=compile checks
    assert cfg.model.preset == PRESETS[name]
    assert config_lib.typed(cfg).rollout_batch_size == 2560 and config_lib.typed(cfg).updates_per_step == 10
    assert config_lib.typed(cfg).optim.warmup_steps == 286  # 28.5% of 1005 rollout batches
    assert (cfg.model.param_dtype, cfg.rollout.params_dtype) == ("float32", "bfloat16")  # bf16 host-local copies


@pytest.mark.parametrize("name", sorted(TPU_DEVICES))
def test_paper_configs_use_the_papers_retriever(name):
    """e5-base-v2 over Search-R1's exact Flat index of wiki-18 (row i = line i of wiki-18.jsonl), top 3: searched
    on the chips by default (the top 3 proven equal to faiss's), by faiss on the host with the name e5."""
    files = {"index_path": "/data/wiki18/e5_Flat.index", "corpus_path": "/data/wiki18/wiki-18.jsonl",
             "encoder_path": "gs://YOUR_BUCKET/models/e5-base-v2"}
    cfg = load(name)
    assert cfg.retriever.to_dict() == {"backend": "e5_device", **files, "vector_dtype": "int8", "candidates": 32,
                                       "search_batch": 64}
    assert cfg.rollout.retrieval_top_k == 3
    assert load(name, "e5").retriever.to_dict() == {"backend": "faiss", **files}


@pytest.mark.parametrize("name", sorted(TPU_DEVICES))
def test_paper_configs_compute_the_papers_reward(name):
    """Search-R1's compute_score_em: an answer that normalizes to nothing matches a gold answer that does too."""
    rule = load(name).reward.empty_answer
    assert em_reward("<answer>a</answer>", ["a"], rule) == 1.0
    assert em_reward("<answer></answer>", [""], rule) == 1.0
    assert em_reward("<answer>a</answer>", ["Tokyo"], rule) == 0.0



@pytest.mark.parametrize("name, changes", [
    ("qwen7b_v6e", {"run_dir": "gs://YOUR_BUCKET/runs/qwen7b_base_llds_v6e", "mesh.topology": "v6e:4x4",
                    "rollout.kv_pages_per_block": 8}),
    ("qwen7b_v5p", {"run_dir": "gs://YOUR_BUCKET/runs/qwen7b_base_llds_v5p", "mesh.topology": "v5p:2x2x2",
                    "rollout.num_pages": 0, "rollout.kv_pages_per_block": 8, "rollout.queries_per_block": 16}),
])
def test_todays_tpus_run_qwen7b_v4_changing_only_what_the_chip_chooses(name, changes):
    """The v6e and v5p configs are qwen7b_v4.py but for their slice, their attention tiles (chosen at their chip's
    peaks) and, on v5p's 95 GiB, a pool of every slot's worst case: the same model, data, objective, retriever and
    global batch."""
    base, cfg = run_config.flat(load("qwen7b_v4").to_dict()), run_config.flat(load(name).to_dict())
    assert set(base) == set(cfg)
    assert {key: cfg[key] for key in cfg if cfg[key] != base[key]} == changes
    assert config_lib.typed(load(name)).rollout_batch_size == config_lib.typed(load("qwen7b_v4")).rollout_batch_size


def test_named_retriever_alternatives():
    spec = importlib.util.spec_from_file_location("qwen3b_v4_alt", os.path.join(CONFIGS, "qwen3b_v4.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.get_config("bm25_es").retriever.to_dict() == {
        "backend": "elasticsearch", "hosts": "https://YOUR_ES_HOST:9200", "index": "wiki18"}
    assert module.get_config("e5_es").retriever.encoder_path == "gs://YOUR_BUCKET/models/e5-base-v2"
    for name in ("e5_hnsw", "e5_device", "bm25"):
        checks.validate(module.get_config(name), 8)
    assert module.get_config("e5_device").retriever.to_dict() == {
        "backend": "e5_device", "index_path": "/data/wiki18/e5_Flat.index", "corpus_path": "/data/wiki18/wiki-18.jsonl",
        "encoder_path": "gs://YOUR_BUCKET/models/e5-base-v2", "vector_dtype": "int8", "candidates": 32,
        "search_batch": 64}
    with pytest.raises(ValueError, match="retriever 'dense' is not one of e5, e5_hnsw, e5_device, e5_es, bm25_es, "
                                         "bm25"):
        module.get_config("dense")


def test_retriever_keys_are_validated_with_the_config():
    cfg = load("qwen7b_v4")
    cfg.retriever.encoder_dtype = "fp8"
    with pytest.raises(config_lib.ConfigError, match=r"retriever\.encoder_dtype must be one of"):
        checks.validate(cfg)


def test_a_retry_budget_longer_than_the_rollouts_search_timeout_is_named():
    """With the http backend's defaults a failing request gives up after 4 attempts of 10 s and pauses of 0.5, 1
    and 2 s: 43.5 s, within rollout.search_timeout_s = 60; 6 retries take 7 x 10 + 0.5 x 63 = 101.5 s."""
    cfg = load("qwen7b_v4")
    cfg.retriever = ml_collections.ConfigDict({"backend": "http", "url": "http://127.0.0.1:8000/retrieve"})
    checks.validate(cfg)
    cfg.retriever.max_retries = 6
    with pytest.raises(config_lib.ConfigError, match=r"^retriever: a failing request retries for up to 101\.5 s "
                       r"\(timeout_s 10 x 7 attempts \+ backoff\), longer than rollout\.search_timeout_s = 60 s"):
        checks.validate(cfg)
    cfg.rollout.search_timeout_s = 120.0
    checks.validate(cfg)


def test_paper_variants():
    assert load("qwen7b_instruct_v4").objective.llds.lam == 0.3
    assert load("qwen3b_base_ma_v4").objective.llds.answer_weighting == "adaptive"
    assert not load("grpo_baseline_v4").objective.llds.enabled
    base = load("base")
    assert (base.objective.llds.lam, base.objective.llds.gate, base.objective.kl_estimator) == (0.2, "action",
                                                                                                  "low_var_kl")


def test_grpo_baseline_offers_the_setting_of_the_papers_grpo_row():
    """The paper's GRPO row is Search-R1's: 4 search turns in training, the best periodic evaluation before the
    collapse; `:search_r1` changes only those (and the run folder), with any retriever."""
    cfg = load("grpo_baseline_v4", "search_r1")
    checks.validate(cfg, TPU_DEVICES["grpo_baseline_v4"])
    default, search_r1 = load("grpo_baseline_v4").to_dict(), cfg.to_dict()
    changed = {(section, key): (default[section][key], search_r1[section][key]) for section in default
               if isinstance(default[section], dict) for key in default[section]
               if default[section][key] != search_r1[section][key]}
    assert changed == {("rollout", "max_turns"): (3, 4)}
    assert cfg.run_dir != default["run_dir"] and not cfg.objective.llds.enabled and cfg.eval.max_turns == 4
    bm25 = load("grpo_baseline_v4", "bm25_es,search_r1")
    assert bm25.retriever.backend == "elasticsearch" and bm25.rollout.max_turns == 4
    with pytest.raises(ValueError, match="at most one retriever name, got e5, bm25"):
        load("grpo_baseline_v4", "e5,bm25")


@pytest.mark.parametrize("name", ["demo_cpu", "demo_cpu_grpo", "demo_cpu_paper", "demo_cpu_collapse",
                                  "demo_cpu_late_collapse", "demo_cpu_late_study", "demo_cpu_long_horizon",
                                  "demo_cpu_tree_study", "demo_cpu_deep", "tiny_test"])
def test_cpu_configs_follow_the_schema(name):
    cfg = load(name)
    assert cfg.app == "llds_jax.apps.demo" and cfg.demo.enabled  # the demo application prepares the run
    config_lib.check_schema(cfg, config_lib.schema(application.load(cfg)))
    checks.validate(cfg, 1)  # model.path is left to the demo
    cfg.model.path = "/some/model"  # set by llds_jax.apps.demo.prepare at run time
    checks.validate(cfg, 1)


def test_demo_comparison_differs_from_the_demo_only_in_llds_and_stress():
    demo, grpo = load("demo_cpu").to_dict(), load("demo_cpu_grpo").to_dict()
    assert demo["objective"]["llds"]["enabled"] and not grpo["objective"]["llds"]["enabled"]
    assert grpo["demo"] == demo["demo"] and grpo["sft"] == demo["sft"] and grpo["seed"] == demo["seed"]
    changed = {(section, key) for section in demo if isinstance(demo[section], dict)
               for key in demo[section] if demo[section][key] != grpo[section][key]}
    assert changed == {("objective", "llds"), ("optim", "mini_batch_size"), ("optim", "micro_batch_size"),
                       ("optim", "learning_rate")}


def test_collapse_regime_is_the_stress_setting_at_twice_its_learning_rate_for_30_steps():
    stress, collapse = load("demo_cpu_grpo").to_dict(), load("demo_cpu_collapse").to_dict()
    changed = {(section, key): (stress[section][key], collapse[section][key]) for section in stress
               if isinstance(stress[section], dict) for key in stress[section]
               if stress[section][key] != collapse[section][key]}
    assert changed == {("optim", "learning_rate"): (5e-4, 1e-3), ("train", "total_steps"): (20, 30)}
    assert collapse["seed"] == stress["seed"]  # the same world and warm start per seed (the study sets the seed)


@pytest.mark.parametrize("argument, learning_rate", [((), 6e-4), (("7e-4",), 7e-4)])
def test_late_collapse_calibration_is_the_stress_setting_for_60_steps_at_the_learning_rate_given(argument,
                                                                                               learning_rate):
    stress, late = load("demo_cpu_grpo").to_dict(), load("demo_cpu_late_collapse", *argument).to_dict()
    changed = {(section, key): (stress[section][key], late[section][key]) for section in stress
               if isinstance(stress[section], dict) for key in stress[section]
               if stress[section][key] != late[section][key]}
    assert changed == {("optim", "learning_rate"): (5e-4, learning_rate), ("train", "total_steps"): (20, 60),
                       ("train", "eval_every"): (0, 10)}
    assert late["seed"] == stress["seed"]


def test_late_collapse_study_is_the_calibrations_lr_5e4_for_80_steps():
    calibration, study = load("demo_cpu_late_collapse", "5e-4").to_dict(), load("demo_cpu_late_study").to_dict()
    changed = {(section, key): (calibration[section][key], study[section][key]) for section in calibration
               if isinstance(calibration[section], dict) for key in calibration[section]
               if calibration[section][key] != study[section][key]}
    assert changed == {("train", "total_steps"): (60, 80)}
    assert study["optim"]["learning_rate"] == 5e-4 and study["seed"] == calibration["seed"]


@pytest.mark.parametrize("argument, learning_rate", [((), 2e-4), (("1e-4",), 1e-4)])
def test_long_horizon_calibration_is_the_late_collapse_setting_for_200_steps(argument, learning_rate):
    late, long = load("demo_cpu_late_collapse", str(learning_rate)).to_dict(), \
        load("demo_cpu_long_horizon", *argument).to_dict()
    changed = {(section, key): (late[section][key], long[section][key]) for section in late
               if isinstance(late[section], dict) for key in late[section]
               if late[section][key] != long[section][key]}
    assert changed == {("train", "total_steps"): (60, 200)}
    assert long["optim"]["learning_rate"] == learning_rate and long["seed"] == late["seed"]


def test_tree_study_is_the_demo_with_an_evaluation_every_5_steps():
    demo, study = load("demo_cpu").to_dict(), load("demo_cpu_tree_study").to_dict()
    changed = {(section, key): (demo[section][key], study[section][key]) for section in demo
               if isinstance(demo[section], dict) for key in demo[section] if demo[section][key] != study[section][key]}
    assert changed == {("train", "eval_every"): (0, 5)} and study["seed"] == demo["seed"]
    assert study["run_dir"] != demo["run_dir"]


def test_deep_demo_is_the_demo_on_the_khop_world_with_the_turns_it_needs():
    demo, deep = load("demo_cpu").to_dict(), load("demo_cpu_deep").to_dict()
    changed = {(section, key): (demo[section][key], deep[section][key]) for section in demo
               if isinstance(demo[section], dict) for key in demo[section] if demo[section][key] != deep[section][key]}
    assert changed == {("demo", "world"): ("two_hop", "khop"),
                       ("demo", "assets_dir"): ("runs/demo_world", "runs/demo_world_deep"),
                       ("sft", "output_dir"): ("runs/demo_world/warm_start", "runs/demo_world_deep/warm_start"),
                       ("rollout", "max_turns"): (2, 8), ("eval", "max_turns"): (2, 8),
                       ("rollout", "max_context_tokens"): (512, 768), ("optim", "pack_row_tokens"): (384, 768),
                       ("rollout", "context_policy"): ("none", "drop_observations")}
    assert (deep["run_dir"], deep["seed"]) == ("runs/demo_cpu_deep", demo["seed"])


def test_paper_shaped_demo_has_the_papers_update_schedule_on_the_demos_world_and_warm_start():
    """10 updates per rollout batch, each of 2 whole groups, linear warmup over 28.5% of the steps."""
    demo, paper = load("demo_cpu"), load("demo_cpu_paper")
    assert config_lib.typed(paper).updates_per_step == 10 and config_lib.typed(paper).rollout_batch_size == 80
    assert paper.optim.mini_batch_size // paper.data.samples_per_prompt == 2
    assert paper.optim.mini_batch_size % paper.data.samples_per_prompt == 0
    assert config_lib.typed(paper).optim.warmup_steps == 5 and paper.optim.learning_rate == demo.optim.learning_rate
    assert paper.demo.to_dict() == demo.demo.to_dict() and paper.sft.to_dict() == demo.sft.to_dict()


@pytest.mark.parametrize("key, value, message", [
    ("mesh.topology", "v4-33", r"mesh\.topology: unknown TPU topology 'v4-33'; valid: v4:2x2x1, "),
    ("model.preset", "qwen9-7b", r"model\.preset 'qwen9-7b' is not one of \['llama-3\.2-3b', "),
    ("rollout.tensor_parallel", -2, r"rollout\.tensor_parallel must be >= 1 \(or -1: all of a host's chips, 0: "
                                    r"the training layout\), got -2"),
    ("reward.empty_answer", "strict", r"reward\.empty_answer must be one of 'search_r1', 'zero', got 'strict'"),
    ("objective.advantages", "tree", r"objective\.advantages must be one of 'grpo', 'tree_grpo', got 'tree'"),
])
def test_bad_topology_or_preset_is_named(key, value, message):
    cfg = load("qwen7b_v4")
    section, name = key.split(".")
    cfg[section][name] = value
    with pytest.raises(config_lib.ConfigError, match=message):
        checks.validate(cfg, 16)


@pytest.mark.parametrize("param_dtype, rollout_dtype, message", [
    ("float32", "int8", r"rollout\.params_dtype must be one of 'float32', 'bfloat16', got 'int8'"),
    ("bfloat16", "float32", r"rollout\.params_dtype \('float32'\) must not be wider than model\.param_dtype "
                            r"\('bfloat16'\)"),
])
def test_bad_rollout_params_dtype_is_named(param_dtype, rollout_dtype, message):
    cfg = load("qwen7b_v4")
    cfg.model.param_dtype, cfg.rollout.params_dtype = param_dtype, rollout_dtype
    with pytest.raises(config_lib.ConfigError, match=message):
        checks.validate(cfg, 16)


def test_unknown_key_in_a_config_file_is_named():
    cfg = load("base")
    cfg.objective.llds.unlock()
    cfg.objective.llds.lamda = 0.3
    with pytest.raises(config_lib.ConfigError, match=r"unknown config key 'objective\.llds\.lamda'"):
        config_lib.check_schema(cfg)


@pytest.mark.parametrize("key", sorted(config_lib.REMOVED_KEYS))
def test_a_removed_key_in_a_config_file_is_named_with_why_it_went(key):
    cfg = load("base")
    section, name = key.split(".")
    cfg[section].unlock()
    cfg[section][name] = 0
    with pytest.raises(config_lib.ConfigError, match=rf"unknown config key '{re.escape(key)}': removed, the paged "
                                                    r"engine is now the only rollout engine"):
        config_lib.check_schema(cfg)


def test_wrong_type_in_a_config_file_is_named():
    cfg = load("base")
    del cfg.optim["learning_rate"]
    cfg.optim.learning_rate = "1e-6"
    with pytest.raises(config_lib.ConfigError, match=r"config key 'optim\.learning_rate' must be float, got str"):
        config_lib.check_schema(cfg)


def test_mlp_chunks_with_a_tensor_axis_is_named():
    cfg = load("qwen7b_v4")
    cfg.model.mlp_chunks, cfg.mesh.fsdp, cfg.mesh.tensor = 2, 8, 2
    with pytest.raises(config_lib.ConfigError, match=r"model\.mlp_chunks = 2 slices the MLP width, which "
                                                    r"mesh\.tensor = 2 shards: use one or the other"):
        checks.validate(cfg, 16)
    cfg.mesh.fsdp, cfg.mesh.tensor = -1, 1
    checks.validate(cfg, 16)


def test_impossible_batch_split_is_named():
    cfg = load("qwen7b_v4")
    cfg.optim.micro_batch_size = 8
    with pytest.raises(config_lib.ConfigError, match=r"optim\.micro_batch_size \(8\) must be a multiple of the "
                                                    r"mesh's batch axes data x fsdp = 16"):
        checks.validate(cfg, 16)
    cfg = load("qwen7b_v4")
    cfg.data.prompts_per_step = 500
    with pytest.raises(config_lib.ConfigError, match=r"optim\.mini_batch_size \(256\) must divide the rollout "
                                                    r"batch data\.prompts_per_step x data\.samples_per_prompt = 2500"):
        checks.validate(cfg, 16)
    with pytest.raises(ValueError, match=r"16 devices cannot be split into data=1 x fsdp=-1 x tensor=3"):
        cfg = load("qwen7b_v4")
        cfg.mesh.tensor = 3
        checks.validate(cfg, 16)


def test_file_lists_are_overridden_on_the_command_line():
    """config_flags can override a tuple key (one flag per item), never a list one."""
    argv = ["launch", f"--config={os.path.join(CONFIGS, 'qwen7b_v4.py')}", "--config.data.train_files=/d/a.parquet",
            "--config.data.train_files=gs://b/b.parquet", "--config.data.eval_files=/d/test.parquet",
            "--config.sft.data_files=/d/demos.jsonl"]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=flag_values, lock_config=True, sys_argv=argv)
    flag_values(argv)
    cfg = flag_values.config
    assert cfg.data.train_files == ("/d/a.parquet", "gs://b/b.parquet")
    assert (cfg.data.eval_files, cfg.sft.data_files, cfg.sft.curriculum_files) == (("/d/test.parquet",),
                                                                                    ("/d/demos.jsonl",), ())


def test_config_module_loads_without_jax_and_checks_validates_the_llds_variant():
    """`import llds_jax.config` loads no JAX (a fresh process) and checks what it owns; `checks.validate` then
    checks the registered loss terms."""
    script = textwrap.dedent("""\
        import sys
        import llds_jax.config as config_lib
        cfg = config_lib.default_config()
        cfg.model.path = "/some/model"
        cfg.objective.llds.variant = "lldz"
        config_lib.check(cfg)
        assert "jax" not in sys.modules, sorted(m for m in sys.modules if m.startswith("llds_jax"))
        from llds_jax import checks
        try:
            checks.validate(cfg)
        except config_lib.ConfigError as e:
            print(e)
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == ("objective.llds.variant must be one of 'llds', 'policy', 'entropy', 'kl', "
                                   "got 'lldz'")


def test_a_config_imports_the_one_it_builds_on_from_its_own_folder(tmp_path):
    """`from configs import qwen7b_v4 as base` finds the sibling of the config file the launch command was given,
    whatever the working directory: here a copy of configs/ whose qwen7b_v4.py differs, loaded from elsewhere."""
    copy = tmp_path / "checkout" / "configs"
    copy.mkdir(parents=True)
    for name in ("__init__", "qwen7b_v4", "qwen3b_v4", "llama3b_v4"):
        text = open(os.path.join(CONFIGS, name + ".py"), encoding="utf-8").read()
        if name == "qwen7b_v4":
            assert text.count("    return c\n") == 1
            text = text.replace("    return c\n", "    c.seed = 7\n    return c\n")
        (copy / (name + ".py")).write_text(text, encoding="utf-8")
    script = ("import sys; from absl import flags; from llds_jax import launch; "
              "launch.parse_flags(['launch', '--config=' + sys.argv[1]]); c = flags.FLAGS.config; "
              "print(c.seed, c.model.preset, c.objective.llds.answer_weighting, sys.modules['configs'].__file__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.run([sys.executable, "-c", script, str(copy / "llama3b_v4.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["7", "llama-3.2-3b", "adaptive", str(copy / "__init__.py")]


@pytest.mark.parametrize("override, message", [
    ("train.steps=3", "unknown config key train.steps (did you mean train.total_steps?)"),
    ("rollout.max_turn=3", "unknown config key rollout.max_turn (did you mean rollout.max_turns or "
                           "rollout.max_turn_tokens?)"),
    ("objective.llds.lamda=0.1", "unknown config key objective.llds.lamda (did you mean objective.llds.lam?)"),
    ("demo.num_peple=3", "unknown config key demo.num_peple (did you mean demo.num_people?)"),  # the application's
    ("train.totl_steps=3", "unknown config key train.totl_steps (did you mean train.total_steps?)"),  # not
    # train.stop_within_step, which is 9 edits away
    ("demo.num_persons=3", "unknown config key demo.num_persons"),  # num_people, num_heads: 5 edits away
    ("optim.lamda=1", "unknown config key optim.lamda"),  # nothing near
    ("rollout.engine=paged", "unknown config key rollout.engine: removed, the paged engine is now the only rollout "
                             "engine"),
])
def test_an_unknown_key_suggests_the_nearest(override, message):
    with pytest.raises(KeyError) as raised:
        loader.load_config(os.path.join(CONFIGS, "demo_cpu.py"), [override])
    assert raised.value.args[0] == message


def test_the_edit_distance_counts_insertions_deletions_substitutions_and_swaps():
    pairs = [("totl_steps", "total_steps"), ("trian", "train"), ("lamda", "lam"), ("num_persons", "num_people"),
             ("", "ab"), ("ab", ""), ("lr", "lr"), ("abc", "ca")]  # abc -> ca: 3, a swap is not edited again
    assert [loader.edit_distance(a, b) for a, b in pairs] == [1, 1, 2, 5, 2, 2, 0, 3]


def test_the_printed_summary_says_what_trains_and_redacts_secrets():
    cfg = load("qwen7b_v4")
    cfg.retriever = ml_collections.ConfigDict({"backend": "http", "url": "https://u:s3cret@h:8000/retrieve"})
    text = config_lib.summary(config_lib.typed(cfg))
    assert "s3cret" not in text and "url https://***@h:8000/retrieve" in text
    assert text.splitlines()[1:4] == [
        "  model qwen2.5-7b in float32 (compute bfloat16)",
        "  step: 512 prompts x 5 samples, 10 update(s) of 256 at lr 1e-06; 1005 steps",
        "  objective GRPO + LLDS (lambda 0.2, action gate), KL 0.001, advantages grpo"]
    assert len(text.splitlines()) == 5
    cfg.rollout.trees, cfg.rollout.tree_forks, cfg.rollout.continuous_batching, cfg.rollout.max_batch_size = 1, 4, False, 0
    assert config_lib.summary(config_lib.typed(cfg)).splitlines()[2] == (
        "  step: 512 prompts x 5 samples (1 tree(s) x (1 + 1 x 4) leaves, uniform forks), 10 update(s) of 256 at "
        "lr 1e-06; 1005 steps")


def test_show_prints_a_config_with_its_overrides_and_secrets_redacted_or_names_a_bad_value(capsys):
    """`python -m llds_jax.config show`: a config read before renting (no storage, credentials, model or data)."""
    from llds_jax.config.loader import show

    secret = "--config.retriever.hosts=https://elastic:s3cret@es:9200"
    paper = os.path.join(CONFIGS, "qwen7b_v4.py")
    assert show([f"{paper}:bm25_es", secret, "--config.train.total_steps=7"]) == 0
    shown = capsys.readouterr().out
    assert "s3cret" not in shown and "hosts: https://***@es:9200" in shown and "  total_steps: 7\n" in shown
    assert "  path: gs://YOUR_BUCKET/models/Qwen2.5-7B\n" in shown  # printed, not read
    assert show([paper, "--config.objective.llds.lam=-1"]) == 2
    assert capsys.readouterr().err == "llds_jax: error: objective.llds.lam must be >= 0, got -1.0\n"
    assert show([paper, "extra"]) == 2
    assert "unexpected argument 'extra'" in capsys.readouterr().err
