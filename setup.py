"""Packaging beyond pyproject.toml: the template library lives in the top-level templates/
directory and installs as the forge.templates package data (forge/templates/ in a wheel)."""

from setuptools import find_namespace_packages, setup

LIBRARY_SUBDIRS = find_namespace_packages(where="templates", exclude=["*__pycache__*"])

setup(
    packages=[
        *find_namespace_packages(include=["forge", "forge.*"], exclude=["*__pycache__*"]),
        "forge.templates",
        *(f"forge.templates.{name}" for name in LIBRARY_SUBDIRS),
    ],
    package_dir={"forge.templates": "templates"},
)
