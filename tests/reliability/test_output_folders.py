"""Folders the run did not make are never deleted or written into (issue 58 items 1, 2, 12), with the real commands:
a demo world built for another seed is kept, with the warm start cached in it, and the run is refused in one line
saying what differs and what to do; a `demo.assets_dir` of the user's own files is refused and left as it was; the
report's `--out` naming a file or a folder of other files is one line, and a metrics line that is not UTF-8 is
skipped and counted. Before, the first two deleted the whole folder without a word (the old `build_assets` called
`shutil.rmtree(out_dir)` whenever its COMPLETE record differed or was missing) and the last two were tracebacks."""
import json
import os
import subprocess
import sys

from llds_jax.runtime import output_folder
from llds_jax.apps import demo
from tests.configs import CONFIGS, load

ROOT = os.path.dirname(CONFIGS)
TINY = os.path.join(CONFIGS, "tiny_test.py")


def launch(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "llds_jax.launch", f"--config={TINY}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def files_of(folder) -> dict[str, bytes]:
    """Every file under `folder` by relative path, with its bytes."""
    found = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = f.read()
    return found


def test_a_demo_world_of_another_seed_is_kept_with_its_warm_start_and_the_run_refused(tmp_path):
    assets = tmp_path / "demo_world"
    (assets / "warm_start").mkdir(parents=True)
    (assets / "warm_start" / "warm_start.json").write_text('{"fingerprint": "f"}')
    (assets / "world").mkdir()
    (assets / "world" / "train.parquet").write_bytes(b"PAR1 the world of seed 0")
    (assets / "COMPLETE").write_text(json.dumps(demo.spec_of(load("tiny_test"))))  # seed 0
    before = files_of(assets)
    proc = launch(f"--config.run_dir={tmp_path / 'run'}", f"--config.demo.assets_dir={assets}", "--config.seed=1")
    assert (proc.returncode, proc.stderr) == (2, (
        f"llds_jax: error: demo.assets_dir {assets} holds demo assets built for other settings (seed 0 there, 1 "
        "here): nothing was deleted; set demo.assets_dir to another folder (or delete that one)\n"))
    after = files_of(assets)
    assert after.pop(output_folder.MARKER) == b'{"kind": "demo assets"}'  # a COMPLETE is the project's: claimed
    assert after == before


def test_an_assets_dir_of_the_users_files_is_refused_and_left_as_it_was(tmp_path):
    assets = tmp_path / "mine"
    (assets / "thesis").mkdir(parents=True)
    (assets / "thesis" / "chapter1.tex").write_text("\\section{Intro}")
    (assets / "notes.txt").write_text("do not lose")
    before = files_of(assets)
    proc = launch(f"--config.run_dir={tmp_path / 'run'}", f"--config.demo.assets_dir={assets}")
    assert (proc.returncode, proc.stderr) == (2, (
        f"llds_jax: error: demo.assets_dir {assets} holds files llds_jax did not write (notes.txt, thesis): nothing "
        "was written or deleted; name an empty or new folder for the demo assets\n"))
    assert files_of(assets) == before


def test_a_run_dir_of_the_users_files_is_refused_and_left_as_it_was(tmp_path):
    """Training writes config.json, metrics.jsonl and checkpoints/ into run_dir: over a user's own config.json
    before. An empty folder, one of an earlier run (metrics.jsonl, checkpoints/ ...) or a marked one is the run's."""
    run_dir = tmp_path / "papers"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"my": "settings"}')
    proc = launch(f"--config.run_dir={run_dir}", f"--config.demo.assets_dir={tmp_path / 'assets'}")
    assert (proc.returncode, proc.stderr) == (2, (
        f"llds_jax: error: run_dir {run_dir} holds files llds_jax did not write (config.json): nothing was written "
        "or deleted; name an empty or new folder for the run folder\n"))
    assert os.listdir(run_dir) == ["config.json"] and not (tmp_path / "assets").exists()


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llds_jax.train.report", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def write_run(run_dir, lines: list[bytes]) -> None:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")


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
    assert (proc.returncode, proc.stderr) == (
        2, f"llds_jax.train.report: error: --out {out_file} is a file, not a folder: name a folder (or move the file "
           "away)\n")
    assert out_file.read_text() == "my notes"
    papers = tmp_path / "papers"
    papers.mkdir()
    (papers / "summary.md").write_text("my summary")
    (papers / "draft.pdf").write_bytes(b"%PDF")
    proc = report(str(run_dir), "--out", str(papers))
    assert (proc.returncode, proc.stderr) == (
        2, f"llds_jax.train.report: error: --out {papers} holds files llds_jax did not write (draft.pdf, summary.md): "
           "nothing was written or deleted; name an empty or new folder for the report\n")
    assert (papers / "summary.md").read_text() == "my summary"
    proc = report(str(run_dir))  # its own folder, then again: the report's folder is written over
    assert proc.returncode == 0 and report(str(run_dir)).returncode == 0
