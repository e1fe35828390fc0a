"""Build hooks that pyproject.toml cannot express: the native C extension
(``native/ggpipe_native.c`` -> ``ggpipe._native``) and shipping the top-level
``models.toml`` inside the package so an installed ggpipe finds its registry."""

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent


class BuildPyWithRegistry(build_py):
    def run(self):
        super().run()
        src = ROOT / "models.toml"
        if src.exists():
            dst = Path(self.build_lib) / "ggpipe" / "models.toml"
            dst.parent.mkdir(parents=True, exist_ok=True)
            self.copy_file(str(src), str(dst))


setup(
    ext_modules=[
        Extension(
            "ggpipe._native",
            sources=["native/ggpipe_native.c"],
            extra_compile_args=["-O2", "-std=c11"],
            libraries=["dl"],
        )
    ],
    cmdclass={"build_py": BuildPyWithRegistry},
)
