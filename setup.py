"""The optional compiled piece (``ipcsync._native``, see ipcsync/backends/native.py); the
rest of the metadata is in pyproject.toml. ``optional=True``: where there is no C compiler
or no Python headers the build of the extension is skipped with a warning and ipcsync
installs and runs on its pure-Python (torch) path."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ipcsync._native", ["ipcsync/_native.c"], optional=True,
                             extra_compile_args=["-O2", "-std=c99"]),
                   Extension("ipcsync._fault", ["ipcsync/_fault.c"], optional=True,
                             extra_compile_args=["-O2", "-std=c99"])])
