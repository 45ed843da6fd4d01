"""Build the C extension (pyproject.toml has the rest): optimised, with the machine's compiler."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "nexuskv_native._native",
            sources=["nexuskv_native/_native.c", "nexuskv_native/_keys.c", "nexuskv_native/_table.c"],
            depends=["nexuskv_native/_blake2b.h", "nexuskv_native/_native.h"],
            extra_link_args=["-pthread"],
            extra_compile_args=["-O3", "-std=c11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
        )
    ]
)
