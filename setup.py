"""The one native piece, the router's relay pump thread (router/_pump.c).

It is optional and Linux-only (epoll, eventfd): without a C compiler, or on another system, the
build goes on without it and router.relay uses its pure-Python pump, which behaves the same and
costs more CPU per relayed event."""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "router._pump",
            ["router/_pump.c"],
            depends=["router/_pump_const.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
            optional=True,
        )
    ]
    if sys.platform.startswith("linux")
    else []
)
