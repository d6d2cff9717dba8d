"""Builds csrc/ into a plain shared library that zenflow loads with ctypes.

The kernels pick their instruction set at run time (function target attributes plus CPU
feature checks), so one build serves AVX-512, AVX2 and scalar machines alike.
"""

from pathlib import Path

from setuptools import Extension, setup

cpu_adam = Extension(
    "zenflow._cpu_adam",
    sources=sorted(str(p) for p in Path("csrc").glob("*.cpp")),
    depends=sorted(str(p) for p in Path("csrc").glob("*.h")),
    include_dirs=["csrc"],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-pthread"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[cpu_adam])
