"""The flags the README names for the launch command are in its `--help` (issue 70 item 5: `--verbosity` was not)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Flags of other commands that the README names in a span of their own, and the command whose `--help` lists each.
OTHER_COMMANDS = {"settings": "llds_jax.apps.demo_study"}


def helps(module: str) -> str:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def readme_launch_flags(text: str) -> set[str]:
    """The names of the flags in the README's code (backtick spans and indented lines) that go to the launch
    command: those of a span or line that runs it (`python -m llds_jax.launch`, `launch/run.sh`) and those of a
    span that starts with a flag (`--verbosity=0`), but OTHER_COMMANDS'. `--config.KEY=VALUE` is `--config`."""
    spans = re.findall(r"`([^`\n]+)`", text) + [line for line in text.splitlines() if line.startswith("    ")]
    names = set()
    for span in spans:
        if "llds_jax.launch" in span or "launch/run.sh" in span or span.startswith("--"):
            names.update(re.findall(r"(?<![\w-])--([a-z_]+)", span))
    return names - OTHER_COMMANDS.keys()


def test_the_readme_reads_as_the_test_does():
    assert readme_launch_flags("run `python -m llds_jax.launch --config=c.py --mode=eval` or (`--settings a`, "
                               "`--verbosity=0`; `--config.train.total_steps=3`), not `python -m pytest --dist x`"
                               "\n    launch/run.sh --topology=v4-8\n") == {
        "config", "mode", "verbosity", "topology"}


def test_every_launch_flag_the_readme_names_is_in_its_help():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        named = readme_launch_flags(f.read())
    assert {"config", "mode", "print_config", "verbosity"} <= named
    text = helps("llds_jax.launch")
    assert sorted(name for name in named if not re.search(rf"--(\[no\])?{name}:", text)) == []
    for name, module in OTHER_COMMANDS.items():
        assert f"--{name}" in helps(module)
