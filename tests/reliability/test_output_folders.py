"""Folders the run did not make are never deleted or written into (issue 58 items 1, 2, 12; issue 66 item 1), with
the real commands. A folder is the project's only when its contents prove it (llds_jax.runtime.output_folder): the
marker the project writes, or for an older version's folder files whose content is what that version wrote. Under
every output-folder key (run_dir in train and eval, demo.assets_dir, sft.output_dir, --export_dir, the report's
--out, the index builder's --out with --overwrite and its OUT.partial) a folder of the user's own files named like
the project's (a COMPLETE of any text, metrics.jsonl, warm_start.json, config.json, model.safetensors, model/ with a
user file) is refused in one line with exit status 2 and is byte-identical afterwards. Before (0e0871a) a file name
was enough: the demo deleted model/ and replaced COMPLETE (issue 66's exact steps), the warm start truncated
metrics.jsonl, a run, an evaluation or an export wrote over config.json, the report over summary.md, and the index
builder removed the folder. Also: a demo world built for another seed is kept with its warm start and the run is
refused saying what differs; a metrics line that is not UTF-8 is skipped and counted by the report."""
import json
import os
import subprocess
import sys

import pytest

from llds_jax.apps import demo
from llds_jax.runtime import output_folder
from tests.configs import CONFIGS, load

ROOT = os.path.dirname(CONFIGS)
TINY = os.path.join(CONFIGS, "tiny_test.py")
ERROR = "llds_jax: error: "
# The tiny world of the warm start (tests/reliability/test_warm_start_faults.py).
TINY_WORLD = ("--config.demo.tokenizer=world", "--config.demo.vocab_size=512", "--config.demo.num_people=12",
              "--config.sft.batch_size=8", "--config.sft.warmup_steps=1")


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def launch(*args: str) -> subprocess.CompletedProcess:
    return run("-m", "llds_jax.launch", f"--config={TINY}", *args)


def files_of(folder) -> dict[str, bytes | None]:
    """Every file (with its bytes) and folder (None) under `folder` by relative path."""
    found = {}
    for parent, folders, names in os.walk(folder):
        for name in folders:
            found[os.path.relpath(os.path.join(parent, name), folder)] = None
        for name in names:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = f.read()
    return found


def users_folder(folder) -> dict[str, bytes | None]:
    """Writes a folder of the user's own files named as the project names its own, as issue 66 found them; returns
    its contents (files_of)."""
    os.makedirs(os.path.join(folder, "model"))
    os.makedirs(os.path.join(folder, "notes"))
    own = {"COMPLETE": b"build finished\n", "metrics.jsonl": b'{"epoch": 1, "loss": 2.31}\n{"epoch": 2, "loss": 1.7}\n',
           "warm_start.json": b'{"lr": 0.1}\n', "config.json": b'{"my": "settings"}\n',
           "model.safetensors": b"my own weights", "model/my_weights.bin": b"my own weights\n",
           "notes/precious.txt": b"precious\n"}
    for name, content in own.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(content)
    return files_of(folder)


def assert_refused(proc: subprocess.CompletedProcess, prefix: str, line: str) -> None:
    """Exit status 2, and stderr is one line: `line` after `prefix`."""
    assert (proc.returncode, proc.stderr) == (2, f"{prefix}{line}\n"), proc.stderr[-4000:]


def not_ours(key: str, folder, kind: str) -> str:
    return (f"{key} {folder} holds files llds_jax did not write (COMPLETE, config.json, metrics.jsonl and 4 more): "
            f"nothing was written or deleted; name an empty or new folder for the {kind}")


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_run_dir_of_the_users_files_named_like_ours_is_refused_and_left_as_it_was(tmp_path, mode):
    """Training and evaluating write config.json, metrics.jsonl and eval/ into run_dir: a metrics.jsonl was enough
    to adopt it before. Refused before the demo builds anything."""
    run_dir = tmp_path / "papers"
    before = users_folder(run_dir)
    proc = launch(f"--mode={mode}", f"--config.run_dir={run_dir}", f"--config.demo.assets_dir={tmp_path / 'assets'}")
    assert_refused(proc, ERROR, not_ours("run_dir", run_dir, "run folder"))
    assert files_of(run_dir) == before and not (tmp_path / "assets").exists()


def test_an_assets_dir_of_the_users_files_named_like_ours_is_refused_and_left_as_it_was(tmp_path):
    """Issue 66's steps: a COMPLETE of any text and a model/ folder, with the warm start off. Before, the demo took
    the folder for its own unfinished build, deleted model/ and wrote its spec over COMPLETE, without a word."""
    assets = tmp_path / "S" / "userdata"
    before = users_folder(assets)
    proc = launch(f"--config.run_dir={tmp_path / 'runs' / 'x'}", f"--config.demo.assets_dir={assets}",
                  "--config.sft.enabled=False")
    assert_refused(proc, ERROR, not_ours("demo.assets_dir", assets, "demo assets"))
    assert files_of(assets) == before


@pytest.mark.slow
def test_a_warm_start_folder_of_the_users_files_named_like_ours_is_refused_and_left_as_it_was(tmp_path):
    """Before, a metrics.jsonl (every training tool writes one) or a warm_start.json adopted the folder: the log was
    truncated as the warm start began, and the finished warm start saved over config.json and model.safetensors."""
    out = tmp_path / "my_training"
    before = users_folder(out)
    proc = launch("--mode=sft", f"--config.run_dir={tmp_path / 'run'}", f"--config.demo.assets_dir={tmp_path / 'a'}",
                  "--config.sft.enabled=True", "--config.sft.steps=2", f"--config.sft.output_dir={out}", *TINY_WORLD)
    assert_refused(proc, ERROR, not_ours("sft.output_dir", out, "warm start"))
    assert files_of(out) == before


def test_an_export_dir_of_the_users_files_named_like_ours_is_refused_and_left_as_it_was(tmp_path):
    """Before, only writability was checked: the export saved the policy over config.json and model.safetensors."""
    export_dir = tmp_path / "hf_model"
    before = users_folder(export_dir)
    proc = launch("--mode=export", f"--export_dir={export_dir}", f"--config.run_dir={tmp_path / 'run'}",
                  f"--config.demo.assets_dir={tmp_path / 'assets'}")
    assert_refused(proc, ERROR, not_ours("--export_dir", export_dir, "export"))
    assert files_of(export_dir) == before


def write_run(run_dir, lines: list[bytes]) -> None:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")


def report(*args: str) -> subprocess.CompletedProcess:
    return run("-m", "llds_jax.train.report", *args, timeout=120)


def test_a_report_out_of_the_users_files_named_like_ours_is_refused_and_left_as_it_was(tmp_path):
    """Before, a folder whose entries all had the report's names (summary.md, reward_em.png) was written over."""
    run_dir = tmp_path / "run"
    write_run(run_dir, [b'{"step": 1, "reward/mean": 0.1}'])
    papers = tmp_path / "papers"
    papers.mkdir()
    (papers / "summary.md").write_text("# My summary of the experiments\n")
    (papers / "reward_em.png").write_bytes(b"\x89PNG my own figure")
    before = files_of(papers)
    proc = report(str(run_dir), "--out", str(papers))
    assert_refused(proc, "llds_jax.train.report: error: ", (
        f"--out {papers} holds files llds_jax did not write (reward_em.png, summary.md): nothing was written or "
        "deleted; name an empty or new folder for the report"))
    assert files_of(papers) == before
    older = tmp_path / "older_report"  # an older version's report, before the marker: its summary.md proves it
    older.mkdir()
    (older / "summary.md").write_text("# Run report: run\n\nstale\n")
    assert report(str(run_dir), "--out", str(older)).returncode == 0
    assert (older / "summary.md").read_text().startswith("# Run report: run\n\n## Config highlights")


def corpus(tmp_path) -> str:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "contents": f'"T{i}"\nriver village number {i}'}) + "\n"
                            for i in range(20)))
    return str(path)


def index_builder(*args: str) -> subprocess.CompletedProcess:
    return run("-m", "index_builder", "--no-progress", *args, timeout=120)


def test_the_index_builders_out_and_partial_folders_of_the_users_files_are_refused_and_left_as_they_were(tmp_path):
    """--overwrite removed --out whatever it held, and a bm25 build removed OUT.partial whatever it held."""
    source = corpus(tmp_path)
    out = tmp_path / "wiki_index"
    users_folder(out)
    (out / "llds_index.json").write_text("my index notes\n")
    before = files_of(out)
    proc = index_builder(source, "--to", "bm25", "--out", str(out), "--overwrite")
    assert_refused(proc, "error: ", (
        f"--out {out} holds files llds_jax did not write (COMPLETE, config.json, llds_index.json and 5 more): nothing "
        "was written or deleted; name an empty or new folder for the index"))
    assert files_of(out) == before
    fresh = tmp_path / "fresh"
    partial = tmp_path / "fresh.partial"
    before = users_folder(partial)
    proc = index_builder(source, "--to", "bm25", "--out", str(fresh))
    assert_refused(proc, "error: ", not_ours("--out", partial, "index"))
    assert files_of(partial) == before and not fresh.exists()
    assert index_builder(source, "--to", "bm25", "--out", str(tmp_path / "mine")).returncode == 0
    proc = index_builder(source, "--to", "bm25", "--out", str(tmp_path / "mine"), "--overwrite")
    assert proc.returncode == 0, proc.stderr  # its own index (before the marker too: its manifest proves it)


def test_claim_adopts_an_older_versions_folder_only_by_its_contents(tmp_path):
    """An unmarked folder an older version wrote is adopted when a file's content is what that version wrote (a
    COMPLETE holding a demo spec); the same names with other content are not; a cut marker proves nothing."""
    spec = demo.spec_of(load("tiny_test"))
    older = tmp_path / "older"
    (older / "model").mkdir(parents=True)
    (older / "COMPLETE").write_text(json.dumps(spec))
    output_folder.claim(str(older), "demo.assets_dir", demo.ASSETS, spec)
    assert json.loads((older / output_folder.MARKER).read_text()) == {"kind": "demo assets", "spec": spec}
    assert demo.build_assets(str(older), spec)["model"] == str(older / "model")  # reused, nothing built
    assert sorted(os.listdir(older)) == [output_folder.MARKER, "COMPLETE", "model"]
    named = tmp_path / "named"
    (named / "model").mkdir(parents=True)
    (named / "COMPLETE").write_text(json.dumps({**spec, "mine": 1}))  # a JSON object, but not a demo spec
    (named / output_folder.MARKER).write_text('{"kind": "demo')  # cut: proves nothing
    with pytest.raises(output_folder.FolderNotOursError, match=r"holds files llds_jax did not write \(COMPLETE, "
                                                               r"model\)"):
        output_folder.claim(str(named), "demo.assets_dir", demo.ASSETS, spec)
    report = tmp_path / "report"
    report.mkdir()
    (report / output_folder.MARKER).write_text('{"kind": "report", "spec": null}')
    with pytest.raises(output_folder.FolderNotOursError, match="holds another output of llds_jax \\(report\\)"):
        output_folder.claim(str(report), "demo.assets_dir", demo.ASSETS, spec)


def test_a_demo_world_of_another_seed_is_kept_with_its_warm_start_and_the_run_refused(tmp_path):
    assets = tmp_path / "demo_world"
    (assets / "warm_start").mkdir(parents=True)
    (assets / "warm_start" / "warm_start.json").write_text('{"fingerprint": "f"}')
    (assets / "world").mkdir()
    (assets / "world" / "train.parquet").write_bytes(b"PAR1 the world of seed 0")
    (assets / "COMPLETE").write_text(json.dumps(demo.spec_of(load("tiny_test"))))  # seed 0
    before = files_of(assets)
    proc = launch(f"--config.run_dir={tmp_path / 'run'}", f"--config.demo.assets_dir={assets}", "--config.seed=1")
    assert_refused(proc, ERROR, (
        f"demo.assets_dir {assets} was written for other settings (seed 0 there, 1 here): nothing was written or "
        "deleted; set demo.assets_dir to another folder (or delete that one)"))
    assert files_of(assets) == before  # not even the marker: a refused folder is not written


def test_an_assets_dir_of_the_users_files_is_refused_and_left_as_it_was(tmp_path):
    assets = tmp_path / "mine"
    (assets / "thesis").mkdir(parents=True)
    (assets / "thesis" / "chapter1.tex").write_text("\\section{Intro}")
    (assets / "notes.txt").write_text("do not lose")
    before = files_of(assets)
    proc = launch(f"--config.run_dir={tmp_path / 'run'}", f"--config.demo.assets_dir={assets}")
    assert_refused(proc, ERROR, (
        f"demo.assets_dir {assets} holds files llds_jax did not write (notes.txt, thesis): nothing was written or "
        "deleted; name an empty or new folder for the demo assets"))
    assert files_of(assets) == before


def test_a_metrics_line_that_is_not_utf8_is_skipped_and_counted(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, [b'{"step": 1, "reward/mean": 0.1}', b'{"step": 2, "reward/mean": \xff\xfe0.2}',
                        b'{"step": 3, "reward/mean": 0.3}'])
    proc = report(str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == f"{run_dir / 'metrics.jsonl'}:2: skipped: not UTF-8 text (byte 27)\n"
    assert "- skipped lines (corrupted JSON): 1" in (run_dir / "report" / "summary.md").read_text()


def test_report_out_naming_a_file_or_a_folder_of_other_files_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, [b'{"step": 1, "reward/mean": 0.1}'])
    out_file = tmp_path / "summary.md"
    out_file.write_text("my notes")
    proc = report(str(run_dir), "--out", str(out_file))
    assert_refused(proc, "llds_jax.train.report: error: ",
                   f"--out {out_file} is a file, not a folder: name a folder (or move the file away)")
    assert out_file.read_text() == "my notes"
    papers = tmp_path / "papers"
    papers.mkdir()
    (papers / "summary.md").write_text("my summary")
    (papers / "draft.pdf").write_bytes(b"%PDF")
    proc = report(str(run_dir), "--out", str(papers))
    assert_refused(proc, "llds_jax.train.report: error: ", (
        f"--out {papers} holds files llds_jax did not write (draft.pdf, summary.md): nothing was written or deleted; "
        "name an empty or new folder for the report"))
    assert (papers / "summary.md").read_text() == "my summary"
    proc = report(str(run_dir))  # its own folder, then again: the report's folder is written over
    assert proc.returncode == 0 and report(str(run_dir)).returncode == 0
