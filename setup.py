"""Build hook only (metadata is in pyproject.toml): ship jobs/ and examples/ as package data.

The folders stay at the top of the repository, where users see them; a built wheel carries a
copy under ``axonmpi/_data/`` so ``axonmpi jobs write DIR`` works without a clone.
"""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = ("jobs", "examples")


class BuildPyWithData(build_py):
    """``build_py`` that also copies jobs/ and examples/ into ``axonmpi/_data/``."""

    def run(self):
        super().run()
        for name in SHIPPED:
            src = os.path.join(HERE, name)
            if not os.path.isdir(src):
                continue
            dst = os.path.join(self.build_lib, "axonmpi", "_data", name)
            os.makedirs(dst, exist_ok=True)
            for f in sorted(os.listdir(src)):
                if os.path.isfile(os.path.join(src, f)) and not f.startswith("."):
                    shutil.copy2(os.path.join(src, f), os.path.join(dst, f))


setup(cmdclass={"build_py": BuildPyWithData})
