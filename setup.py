# Debian's pybuild and older pips need a setup.py; all metadata lives in setup.cfg.
from setuptools import setup

setup()
