"""forge's template language, object graph and projects.

Nothing here imports torch: rendering and checking a config works without the ML stack.
User callables are imported only when a config is checked or built.
"""

from .callables import DEFAULT_ALLOWED_ROOTS, SAFE_BUILTINS
from .config import Config, load_config, parse_config
from .errors import ConfigError, Problem
from .project import LIBRARY_DIR, Project, find_project, load_project
from .render import RenderedConfig, parse_define, render_config

__all__ = [
    "DEFAULT_ALLOWED_ROOTS",
    "LIBRARY_DIR",
    "SAFE_BUILTINS",
    "Config",
    "ConfigError",
    "Problem",
    "Project",
    "RenderedConfig",
    "find_project",
    "load_config",
    "load_project",
    "parse_config",
    "parse_define",
    "render_config",
]
