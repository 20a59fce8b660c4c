# Debian's pybuild and older pips need a setup.py; the metadata lives in
# setup.cfg, except the version, which packaging/version works out from the
# git history (or the gpulib/_version.py a tarball carries) and writes into
# gpulib/_version.py, so that the build installs it with the modules.
import importlib.machinery
import importlib.util
import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
    loader = importlib.machinery.SourceFileLoader(
        "gpulib_packaging_version", os.path.join(HERE, "packaging", "version"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return str(module.write(HERE))


setup(version=_version())
