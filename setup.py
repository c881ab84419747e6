"""The wheel's packages, found rather than listed (everything else is in pyproject.toml): every package under
tokenfan's five roots, and web/'s pages as ``tokenfan_web`` (the directory stays at the top of the repository,
where pyproject.toml's ``packages.find`` cannot rename it). A hand-written list once left ``gateway.http3`` out
of the wheel; tests/e2e/test_install.py checks that the wheel holds every file the code loads."""

from setuptools import find_namespace_packages, setup

ROOTS = ("tokenfan_settings", "tokenfan", "gateway", "engine_worker", "tokenfan_bench")
SKIP = ["__pycache__", "*.__pycache__"]

code = find_namespace_packages(include=[p for root in ROOTS for p in (root, f"{root}.*")], exclude=SKIP)
pages = ["tokenfan_web", *(f"tokenfan_web.{p}" for p in find_namespace_packages("web", exclude=SKIP))]
setup(packages=[*code, *pages])
