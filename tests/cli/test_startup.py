"""Commands that do not train start without loading torch (measured with -X importtime)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from forge.runs import create_run
from tests.helpers import REPO, TINY_LM, run_forge, run_python


def imported_modules(stderr: str) -> set[str]:
    """Module names from `-X importtime` output (``import time: self | cumulative | name``)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def forge_imports(*args: str) -> set[str]:
    result = run_forge(*args, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 0, result.stderr
    modules = imported_modules(result.stderr)
    assert "forge.cli" in modules  # the measurement itself works
    return modules


@pytest.fixture
def project_with_a_checkpoint(tmp_path):
    """A project with one run holding one (damaged) checkpoint, so the table has a row."""
    project = tmp_path / "p"
    (project / "templates" / "configs").mkdir(parents=True)
    (project / "meta.yaml").write_text("name: p\n")
    run_dir = create_run(
        project / "output" / "train",
        config_name="train.yaml",
        config_text="meta: 1\n",
        project_root=project,
        overrides=[],
        variables={},
        nproc=1,
    )
    (run_dir / "checkpoints" / "checkpoint-000010").mkdir(parents=True)
    return project


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("ls", "-p", str(TINY_LM), "--no-check"),
        ("render", "-p", str(TINY_LM)),
        ("render", "-p", str(TINY_LM), "--chain"),
        ("runs", "-p", str(TINY_LM)),
    ],
    ids=lambda args: " ".join(a for a in args if "/" not in a),
)
def test_command_does_not_import_torch(args):
    modules = forge_imports(*args)
    assert "torch" not in modules
    assert "transformers" not in modules


def test_new_and_tb_do_not_import_torch(tmp_path):
    new = forge_imports("new", "p", "--from", "classifier", "-p", str(tmp_path))
    assert "torch" not in new
    (tmp_path / "p" / "output").mkdir()
    tb = forge_imports("tb", "-p", str(tmp_path / "p"), "--print-command")
    assert "torch" not in tb


def test_ls_checks_by_importing_the_callables():
    modules = forge_imports("ls", "-p", str(TINY_LM))

    assert "torch" in modules and "forge.train.loop" in modules


def test_checkpoints_does_not_import_torch(project_with_a_checkpoint):
    modules = forge_imports("checkpoints", "-p", str(project_with_a_checkpoint))
    assert "forge.checkpoint.layout" in modules  # the table was really made
    if "torch" in modules and _layout_imports_torch():
        pytest.xfail("forge.checkpoint.layout still imports torch (through forge.checkpoint.io)")
    assert "torch" not in modules


def _layout_imports_torch() -> bool:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import forge.checkpoint.layout"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    return "torch" in imported_modules(result.stderr)


# A forge process's own entry that loaded torch freezes what it built before the interpreter shuts down, so the
# shutdown's garbage collections pass over torch's and transformers' objects; what was already
# garbage is collected first, so nothing waiting to be finalized is left unfinalized.
EXIT_PROBE = """
import atexit, gc, sys

class Cycle:
    def __init__(self, path):
        self.me = self  # garbage only as a cycle: only the garbage collector finalizes it
        self.path = path

    def __del__(self):
        with open(self.path, "w") as file:
            file.write("finalized")

gc.disable()  # no automatic collection finds it before forge's exit: only the one at exit can
Cycle(sys.argv[1])
atexit.register(lambda: print("frozen", gc.get_freeze_count(), file=sys.stderr))
sys.argv = ["forge", *sys.argv[2:]]
from forge.cli import main
sys.exit(main())
"""


def test_the_process_entry_freezes_what_it_made_and_finalizes_its_garbage_first(tmp_path):
    out = tmp_path / "finalized.txt"
    result = run_python(EXIT_PROBE, str(out), "ls", "-p", str(TINY_LM))
    assert result.returncode == 0, result.stderr
    frozen = int(result.stderr.split("frozen ")[1].split()[0])
    assert frozen > 1000, result.stderr  # forge's and the libraries' objects
    assert out.read_text() == "finalized"  # the garbage left before the freeze was finalized


def test_main_called_from_python_leaves_the_collector_alone(capsys):
    import gc

    from forge.cli import main

    before = gc.get_freeze_count()
    assert main(["ls", "-p", str(TINY_LM), "--no-check"]) == 0
    assert gc.get_freeze_count() == before


def test_a_process_that_leaves_by_os_exit_prepares_no_shutdown():
    """A sweep's forked trial ends by ``os._exit``: no collection for a shutdown it skips."""
    script = (
        "import gc\n"
        "from forge.lifetime import leave_without_shutdown, prepare_a_quick_exit\n"
        "prepare_a_quick_exit(); frozen = gc.get_freeze_count(); gc.unfreeze()\n"
        "leave_without_shutdown(); prepare_a_quick_exit()\n"
        "print(frozen > 0, gc.get_freeze_count())\n"
    )
    result = run_python(script)
    assert result.stdout.split() == ["True", "0"], result.stderr
