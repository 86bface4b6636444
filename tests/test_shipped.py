"""Every shipped template and project renders and checks; the library ships as package data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from forge.config import LIBRARY_DIR, load_config, load_project, render_config
from tests.helpers import REPO

PROJECTS = sorted(p.parent for p in (REPO / "projects").glob("*/meta.yaml"))
LIBRARY_TEMPLATES = sorted(str(p.relative_to(LIBRARY_DIR)) for p in LIBRARY_DIR.rglob("*.yaml"))


def all_project_configs():
    for root in PROJECTS:
        project = load_project(root)
        for name in project.list_configs():
            yield pytest.param(project, name, id=f"{project.name}/{name}")


@pytest.mark.parametrize(("project", "config"), list(all_project_configs()))
def test_project_config_renders_and_checks(project, config):
    cfg = load_config(project, config)
    assert cfg.check() == []
    assert "trainer" in cfg.public_targets and "meta" in cfg.public_targets


# Templates a config includes in one of its blocks rather than extends; each has its own
# test below.
INCLUDED_TEMPLATES = {"trainers/trainer.yaml"}


def test_every_library_template_is_used_by_a_shipped_config():
    used = set()
    for root in PROJECTS:
        project = load_project(root)
        for name in project.list_configs():
            used.update(t for t, _ in render_config(project, name).chain)
    expected = set(LIBRARY_TEMPLATES) - INCLUDED_TEMPLATES
    assert expected <= used, expected - used


def bare_project(tmp_path, config_text):
    (tmp_path / "templates" / "configs").mkdir(parents=True, exist_ok=True)
    (tmp_path / "meta.yaml").write_text("name: bare\n")
    (tmp_path / "templates" / "configs" / "c.yaml").write_text(config_text)
    return load_project(tmp_path)


def test_a_child_overrides_trainer_args_directly(tmp_path):
    project = bare_project(
        tmp_path,
        "-- extends 'projects/causal_lm.yaml'\n"
        "-- block trainer_args\n    == super()\n    max_steps: 7\n    bf16: true\n-- endblock\n",
    )
    cfg = load_config(project, "c")
    assert cfg.check() == []
    args = cfg.targets["trainer"].kwargs["args"]
    assert args.spec == "forge.train:TrainingArguments"
    assert (args.kwargs["max_steps"], args.kwargs["bf16"], args.kwargs["seed"]) == (7, True, 42)


def test_a_child_adds_a_trainer_argument_with_super(tmp_path):
    project = bare_project(
        tmp_path,
        "-- extends 'base.yaml'\n"
        "-- block trainer\n    == super()\n"
        "    optimizer: !partial:torch.optim:SGD {lr: 0.1}\n-- endblock\n",
    )
    cfg = load_config(project, "c")
    assert cfg.check() == []
    trainer = cfg.targets["trainer"]
    assert trainer.spec == "forge.train:Trainer"
    assert trainer.kwargs["optimizer"].spec == "torch.optim:SGD"
    assert trainer.kwargs["args"] is cfg.targets[".trainer_args"]


def test_trainer_template_alone_holds_only_the_trainer(tmp_path):
    project = bare_project(
        tmp_path,
        "-- extends 'base.yaml'\n-- block trainer\n    -- include 'my.trainer'\n-- endblock\n"
        "#---- my.trainer ----\n-- extends 'trainers/trainer.yaml'\n"
        "-- block trainer_args\n    == super()\n    max_steps: 9\n-- endblock\n",
    )
    cfg = load_config(project, "c")
    assert cfg.check() == []
    assert [t for t, _ in render_config(project, "c").chain][-1] == "trainers/trainer.yaml"
    # base.yaml's targets once each: the included trainer template added no second copy
    assert cfg.text.count("\nmeta:") + cfg.text.startswith("meta:") == 1
    assert cfg.text.count("trainer: &trainer") == 1
    assert cfg.targets[".trainer_args"].kwargs["max_steps"] == 9


def test_model_embeds_every_token_id_of_the_tokenizer():
    cfg = load_config(load_project(REPO / "projects" / "tiny_lm"), "train")
    vocab = cfg.targets[".model_config"].kwargs["vocab_size"]
    assert vocab.spec == "forge.data.vocab:vocab_size"
    assert vocab.args == [cfg.targets["tokenizer"]]


def test_base_template_renders_and_checks_alone(tmp_path):
    (tmp_path / "templates" / "configs").mkdir(parents=True)
    (tmp_path / "meta.yaml").write_text("name: bare\n")
    (tmp_path / "templates" / "configs" / "bare.yaml").write_text("-- extends 'base.yaml'\n")
    cfg = load_config(load_project(tmp_path), "bare")
    assert cfg.check() == []
    meta = cfg.build("meta")
    assert meta["project"] == "bare" and meta["trainer"] == "plain"


@pytest.mark.slow
def test_wheel_ships_the_template_library(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(REPO),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            "-q",
        ],
        check=True,
    )
    wheel = next(Path(tmp_path).glob("forge-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for template in LIBRARY_TEMPLATES:
        assert f"forge/templates/{template}" in names
    assert not any(name.startswith("templates/") for name in names)


def fresh_venv(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A venv without pip whose .pth file puts the running environment's site-packages
    (torch, transformers, pip, setuptools, ...) on its path: nothing is downloaded.
    Returns its python, its site-packages and an environment without PYTHONPATH."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([python, "-c", purelib], capture_output=True, text=True, check=True)
    here = subprocess.run([sys.executable, "-c", purelib], capture_output=True, text=True)
    Path(site.stdout.strip(), "forge_test_deps.pth").write_text(here.stdout.strip() + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return python, Path(site.stdout.strip()), env


def pip_install(python: Path, env: dict, *args: str) -> None:
    # --ignore-installed: never touch the forge installed in the running environment
    command = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*command, "--no-index", "--ignore-installed", *args], check=True, env=env)


@pytest.mark.slow
def test_editable_install_uses_the_source_tree_library(tmp_path):
    python, _, env = fresh_venv(tmp_path)
    pip_install(python, env, "-e", str(REPO))
    code = "from forge.config import LIBRARY_DIR; print(LIBRARY_DIR)"
    shown = subprocess.run(
        [python, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    assert Path(shown.stdout.strip()) == REPO / "templates"


@pytest.mark.slow
def test_installed_package_renders_and_trains_tiny_lm_from_elsewhere(tmp_path):
    """A NON-editable `pip install .` into a fresh venv (see fresh_venv: its dependencies
    come from the running environment through a .pth file), used from another directory
    without PYTHONPATH, so only the installed forge and the library inside it are found.
    """
    python, site, env = fresh_venv(tmp_path)
    pip_install(python, env, str(REPO))
    venv = python.parent.parent

    project = tmp_path / "tiny_lm"
    shutil.copytree(REPO / "projects" / "tiny_lm", project, ignore=shutil.ignore_patterns("output"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    forge = str(venv / "bin" / "forge")

    def run(*args):
        result = subprocess.run(
            [forge, *args], cwd=elsewhere, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    chain = run("render", "-p", str(project), "--chain")
    library = site / "forge" / "templates"
    assert f"{library / 'base.yaml'}" in chain
    assert str(REPO) not in chain
    assert "trainer: &trainer !singleton:forge.train:Trainer" in run("render", "-p", str(project))
    quick = ["-D", "max_files=40", "-D", "vocab_size=512", "-D", "max_steps=2"]
    quick += ["-D", "save_steps=2", "-D", "eval_steps=2", "-D", "logging_steps=1"]
    run_dir = Path(run("train", "-p", str(project), *quick).splitlines()[0])
    assert (run_dir / "checkpoints" / "checkpoint-000002" / "manifest.json").is_file()


def library_references():
    """(template, Reference) for every variable a library template sets or defaults."""
    project_root = REPO / "projects" / "tiny_lm"
    rendered = render_config(load_project(project_root), "train")
    for name, info in rendered.templates.items():
        if info.file.startswith(str(LIBRARY_DIR)):
            for ref in info.references:
                yield name, ref


SCAFFOLD_ROOTS = sorted((REPO / "forge" / "scaffolds").glob("*/templates"))
PROJECT_ROOTS = [root / "templates" for root in PROJECTS]


def shipped_templates():
    """(template root, template name) of every template forge ships: the library's, the
    scaffolds' and the example projects'."""
    for root in [LIBRARY_DIR, *SCAFFOLD_ROOTS, *PROJECT_ROOTS]:
        for path in sorted(root.rglob("*.yaml")):
            yield pytest.param(
                root, path.relative_to(root).as_posix(), id=str(path.relative_to(REPO))
            )


@pytest.mark.parametrize(("root", "template"), list(shipped_templates()))
def test_library_sets_variables_only_as_defaults(root, template):
    """`-- set x = x | default(...)` only, in the library, the scaffolds and the shipped
    projects, inline templates included: a child's `-- set x = ...` runs first and wins."""
    from jinja2 import nodes

    from forge.config.render import TemplateLoader
    from forge.config.sandbox import TemplateEnvironment

    env = TemplateEnvironment(loader=TemplateLoader([root, LIBRARY_DIR]))
    sources = {template: env.loader.get_source(env, template)[0]}
    sources |= {name: source for name, (source, _) in env.loader.inline.items()}
    for name, source in sources.items():
        for assign in env.parse(source).find_all(nodes.Assign):
            value = assign.node
            assert (
                isinstance(value, nodes.Filter)
                and value.name == "default"
                and isinstance(value.node, nodes.Name)
                and value.node.name == assign.target.name
            ), f"{name}:{assign.lineno} sets {assign.target.name} without | default"


def shipped_configs(tmp_path: Path) -> list[tuple]:
    """(project, config) for every config of a copy of each shipped project and of a project
    made from each scaffold, all under `tmp_path`."""
    from forge.cli.new import SCAFFOLDS, new_project

    roots = []
    for root in PROJECTS:
        copy = tmp_path / "projects" / root.name
        shutil.copytree(root, copy, ignore=shutil.ignore_patterns("output", "__pycache__"))
        roots.append(copy)
    roots += [new_project(f"from_{kind}", tmp_path / "scaffolds", kind) for kind in SCAFFOLDS]
    projects = [load_project(root) for root in roots]
    return [(project, name) for project in projects for name in project.list_configs()]


def child_of(project, config: str, text: str, name: str = "child"):
    """A config `name` of `project` extending `config` with `text` after the extends."""
    path = project.configs_dir / f"{name}.yaml"
    path.write_text(f"-- extends 'configs/{config}'\n{text}")
    return path


def test_a_childs_set_wins_in_every_shipped_config_and_scaffold(tmp_path):
    """Every variable a shipped config or scaffold sets (config_description, ...) takes a
    child's `-- set` instead."""
    for project, config in shipped_configs(tmp_path):
        rendered = render_config(project, config)
        names = sorted(
            {
                ref.name
                for info in rendered.templates.values()
                for ref in info.references
                if ref.kind == "set" and not info.file.startswith(str(LIBRARY_DIR))
            }
        )
        assert "config_description" in names, (project.name, config)
        sentinels = {name: 900001 + i for i, name in enumerate(names)}
        sets = "".join(f"-- set {name} = {value}\n" for name, value in sentinels.items())
        child_of(project, config, sets)
        text = render_config(project, "child").text
        lost = [name for name, value in sentinels.items() if str(value) not in text]
        assert lost == [], f"{project.name}/{config} won over the child's set for {lost}"


def trainer_args(cfg):
    return cfg.targets["trainer"].kwargs["args"].kwargs


def test_every_training_variable_of_base_reaches_the_arguments_of_every_config(tmp_path):
    """`-D weight_decay=...` (and each variable base.yaml's trainer_args reads) is what the
    trainer gets in every shipped config and scaffold: none writes a plain value over it."""
    defines = {
        "seed": 7,
        "num_train_epochs": 2.5,
        "max_steps": 77,
        "batch_size": 3,
        "eval_batch_size": 5,
        "grad_accum": 2,
        "learning_rate": 0.0123,
        "weight_decay": 0.0456,
        "max_grad_norm": 0.5,
        "lr_scheduler_type": "cosine_with_restarts",
        "warmup_steps": 11,
        "logging_steps": 13,
        "eval_steps": 17,
        "save_steps": 34,
        "save_total_limit": 4,
        "report_to": "none",
    }
    keys = {
        "seed": "seed",
        "num_train_epochs": "num_train_epochs",
        "max_steps": "max_steps",
        "batch_size": "per_device_train_batch_size",
        "eval_batch_size": "per_device_eval_batch_size",
        "grad_accum": "gradient_accumulation_steps",
        "learning_rate": "learning_rate",
        "weight_decay": "weight_decay",
        "max_grad_norm": "max_grad_norm",
        "lr_scheduler_type": "lr_scheduler_type",
        "warmup_steps": "warmup_steps",
        "logging_steps": "logging_steps",
        "eval_steps": "eval_steps",
        "save_steps": "save_steps",
        "save_total_limit": "save_total_limit",
        "report_to": "report_to",
    }
    for project, config in shipped_configs(tmp_path):
        args = trainer_args(load_config(project, config, variables=defines))
        lost = {
            name: args.get(keys[name])
            for name, value in defines.items()
            if args.get(keys[name]) != value
        }
        assert lost == {}, f"{project.name}/{config} ignores -D {sorted(lost)}"


TRAINER_CHOICES = {
    "forge.train:TrainingArguments": "",
    "forge.train:AccelTrainingArguments": (
        "-- from 'trainers/accel_trainer.yaml' import trainer_class, trainer_args_class\n"
    ),
    "forge.train:PipelineTrainingArguments": (
        "-- from 'trainers/pipeline_trainer.yaml' import trainer_class, trainer_args_class, "
        "pipeline_args\n-- block trainer_args\n    == super()\n== pipeline_args()\n-- endblock\n"
    ),
}


@pytest.mark.parametrize("parent", ["base.yaml", "projects/causal_lm.yaml"])
@pytest.mark.parametrize("spec", list(TRAINER_CHOICES))
def test_library_trainer_arguments_are_hugging_faces_defaults(tmp_path, parent, spec):
    """What the library writes into trainer_args is TrainingArguments' default in the
    installed transformers (forge's own fields: the dataclass default), for every trainer."""
    import dataclasses

    import transformers

    from forge.config.callables import Resolver

    cls = Resolver(None, []).resolve(spec)
    hf = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}
    ours = {
        f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(cls)
    }
    text = f"-- extends '{parent}'\n{TRAINER_CHOICES[spec]}"
    args_node = load_config(bare_project(tmp_path, text), "c").targets["trainer"].kwargs["args"]
    assert args_node.spec == spec
    assert "warmup_ratio" not in args_node.kwargs  # no field of transformers 5's arguments
    for key, value in args_node.kwargs.items():
        if key == "output_dir":
            continue
        default = hf[key] if key in hf else ours[key]
        if isinstance(default, tuple):
            default = list(default)
        assert value == default, f"{parent} writes {key}: {value!r}; the default is {default!r}"


def test_hf_port_trains_for_its_epochs(tmp_path):
    """An HF script's num_train_epochs alone decides the length: no library max_steps."""
    project = bare_project(
        tmp_path,
        "-- extends 'base.yaml'\n-- block trainer_args\n    == super()\n"
        "    num_train_epochs: 1\n-- endblock\n",
    )
    args = trainer_args(load_config(project, "c"))
    assert (args["num_train_epochs"], args["max_steps"]) == (1, -1)


def test_a_users_warmup_steps_never_conflicts_with_a_library_default(tmp_path):
    project = bare_project(
        tmp_path,
        "-- extends 'base.yaml'\n-- block trainer_args\n    == super()\n"
        "    warmup_steps: 10\n-- endblock\n",
    )
    cfg = load_config(project, "c")
    assert cfg.check() == []
    assert trainer_args(cfg)["warmup_steps"] == 10


def test_child_set_wins_over_every_library_default(tmp_path):
    names = sorted({ref.name for _, ref in library_references() if ref.kind == "default"})
    assert {"max_steps", "vocab_size", "hidden_size", "weight_decay"} <= set(names)
    sentinels = {name: 900001 + i for i, name in enumerate(names)}
    sets = "".join(f"-- set {name} = {value}\n" for name, value in sentinels.items())
    (tmp_path / "templates" / "configs").mkdir(parents=True)
    (tmp_path / "meta.yaml").write_text("name: child\n")
    (tmp_path / "templates" / "configs" / "c.yaml").write_text(
        "-- extends 'projects/causal_lm.yaml'\n" + sets
    )
    text = render_config(load_project(tmp_path), "c").text
    lost = [name for name, value in sentinels.items() if str(value) not in text]
    assert lost == [], f"the library's default won over the child's set for {lost}"
